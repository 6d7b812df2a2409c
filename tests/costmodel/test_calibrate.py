"""`ctxpar calibrate`'s rank measurements, at small sizes on the CPU (the GPU path
is the same code with a synchronize after each timed call, and larger sizes)."""

from __future__ import annotations

import math

import torch

from ctxpar.costmodel import calibrate as cal
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
    ):
        assert 0 < figure < math.inf


def test_cli_takes_the_device() -> None:
    args = build_parser().parse_args(["calibrate", "--device", "cpu", "--out", "x.json"])
    assert args.device == "cpu"
    assert build_parser().parse_args(["calibrate"]).device == "auto"  # as the engine's --device
