"""`ctxpar calibrate`'s rank measurements, at small sizes on the CPU (the GPU path
is the same code with a synchronize after each timed call, and larger sizes)."""

from __future__ import annotations

import math

import torch

from ctxpar.bench import calibrate as cal
from ctxpar.entrypoints.cli.main import build_parser


def test_rank_figures_at_small_sizes(monkeypatch) -> None:
    monkeypatch.setattr(cal, "BUDGET_S", 0.02)
    cpu = torch.device("cpu")
    for figure in (
        cal.gemm_flops(torch.float32, cpu, (64, 64, 64)),
        cal.gemm_flops(torch.bfloat16, cpu, (64, 64, 64)),
        cal.attention_flops(torch.float32, cpu, (64, 4, 16)),
        cal.attention_flops(torch.bfloat16, cpu, (64, 4, 16)),
        cal.read_bandwidth(cpu, 1 << 20),
        cal.weight_read_bandwidth(torch.float32, cpu, 1 << 20, (256, 64)),
        cal.weight_read_bandwidth(torch.bfloat16, cpu, 1 << 20, (256, 64)),
    ):
        assert 0 < figure < math.inf


def test_cli_takes_the_device() -> None:
    args = build_parser().parse_args(["calibrate", "--device", "cpu", "--out", "x.json"])
    assert args.device == "cpu"
    assert build_parser().parse_args(["calibrate"]).device == "auto"  # as the engine's --device


def test_host_overhead_is_a_cost_a_step_and_a_layer() -> None:
    """Decode steps of the two tiny models through the real engine: a layer costs the host
    some microseconds (a dozen kernel calls and their Python), never nothing."""
    from ctxpar.bench.calibrate_host import host_overhead

    step, layer = host_overhead("fp32", torch.device("cpu"))
    assert 1e-6 < layer < 5e-3 and 0 <= step < 0.1, (step, layer)
