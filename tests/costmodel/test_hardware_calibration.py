"""`ctxpar calibrate`'s rank measurements, at small sizes on the CPU (the GPU path
is the same code with a synchronize after each timed call, and larger sizes)."""

from __future__ import annotations

import math

import pytest
import torch

from ctxpar.costmodel import hardware_calibration as cal
from ctxpar.costmodel.rates import Rates
from ctxpar.entrypoints.cli.main import build_parser
from helpers.calibration import SMALL_LAYERS, small_rank_figures

KV = "kv_read_bandwidth"


def test_rank_figures_at_small_sizes(monkeypatch) -> None:
    monkeypatch.setattr(cal, "BUDGET_S", 0.02)
    cpu = torch.device("cpu")
    for figure in (
        *(cal.gemm_flops(dtype, cpu, [(64, 64, 64), (32, 64, 128)]) for dtype in ("fp32", "bf16", "q4")),
        cal.attention_flops(torch.float32, cpu, (64, 4, 16)),
        cal.attention_flops(torch.bfloat16, cpu, (64, 4, 16)),
        cal.read_bandwidth(cpu, 1 << 20),
        *(cal.weight_read_bandwidth(dtype, cpu, 1 << 20, [(256, 64), (128, 96)]) for dtype in ("fp32", "bf16", "q4")),
        *(cal.kv_read_bandwidth(dtype, 1 << 20, (256, 8, 2, 64)) for dtype in (torch.float32, torch.bfloat16)),
    ):
        assert figure is not None and 0 < figure < math.inf


def test_reads_are_sized_beyond_the_last_level_cache(tmp_path) -> None:
    """The largest cache of a sysfs cache directory as Linux writes it (sizes in K or M),
    0 where it reports none; the reads stream at least twice this machine's."""
    for index, size in enumerate(("48K", "2048K", "491520K", "1M")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert cal.last_level_cache_bytes(tmp_path) == 491520 * 1024
    assert cal.last_level_cache_bytes(tmp_path / "none") == 0
    assert cal.READ_BYTES == max(256 << 20, 2 * cal.last_level_cache_bytes())


def test_the_kv_read_is_timed_only_where_the_paged_kernel_serves(monkeypatch) -> None:
    """With the kernels off the engine reads its cache otherwise: no rate is measured, and
    the profile's KV read falls back to the memory rate (HardwareProfile.kv_read_rate)."""
    monkeypatch.setattr(cal, "BUDGET_S", 0.02)
    monkeypatch.setattr(cal, "KV_SHAPE", (256, 8, 2, 64))
    monkeypatch.setattr(cal, "READ_BYTES", 1 << 20)
    lines: list[str] = []
    measured = cal.kv_read_rates(lines.append).measured
    assert {(r.kind, r.dtype, r.hidden) for r in measured} == {(KV, "fp32", None), (KV, "bf16", None)}
    assert len(lines) == 2 and all("paged decode kernel" in line for line in lines)
    monkeypatch.setenv("CTXPAR_KERNELS", "0")
    assert cal.kv_read_bandwidth(torch.float32) is None and cal.kv_read_rates(lines.append) == Rates()


def test_the_q4_weight_is_a_gguf_q4_0_weight_as_the_engine_loads_it() -> None:
    """What calibrate times for q4: Q4_0's own form (4 bits, half scales per 32, zero 8),
    weights of the usual spread, multiplied by the engine's projection."""
    from ctxpar.costmodel.projection_weights import activation_rows, projection_weight
    from ctxpar.layers.linear import linear
    from ctxpar.layers.quant_linear import QuantWeight

    w = projection_weight("q4", 64, 128, torch.device("cpu"))
    assert isinstance(w, QuantWeight) and (w.bits, w.group, w.zero, w.offsets) == (4, 32, 8, None)
    assert w.scales.dtype == torch.float16 and w.nbytes() == 64 * 128 * 18 // 32
    dense = w.dequantize()
    assert 0.015 < dense.std().item() < 0.025
    x = activation_rows("q4", 3, 128, torch.device("cpu"))
    assert x.dtype == torch.float32
    assert torch.allclose(linear(x, w), x @ dense.T, rtol=0.05, atol=0.05)


def test_projection_rates_cover_every_weight_dtype_and_layer_width(monkeypatch) -> None:
    """Every dtype's GEMM and weight read rates, the read over each layer of WEIGHT_LAYERS,
    the first of which is the dtype's own rate (the profile's, and old profiles' only one)."""
    monkeypatch.setattr(cal, "BUDGET_S", 0.02)
    monkeypatch.setattr(cal, "GEMM_SHAPES", [(64, 64, 64)])
    monkeypatch.setattr(cal, "WEIGHT_LAYERS", SMALL_LAYERS)
    monkeypatch.setattr(cal, "READ_BYTES", 1 << 20)
    lines: list[str] = []
    measured = cal.projection_rates(torch.device("cpu"), lines.append).measured
    rates = {(r.kind, r.dtype, r.hidden): r.value for r in measured}
    dtypes = ("fp32", "bf16", "q4")
    kinds, widths = ("gemm_flops", "weight_read_bandwidth"), (None, 64, 128)
    assert set(rates) == {(kind, d, w) for kind in kinds for d in dtypes for w in widths}
    assert all(0 < r < math.inf for r in rates.values()) and len(lines) == 3
    read = "weight_read_bandwidth"
    assert all(rates[(read, d, None)] == rates[(read, d, 64)] for d in dtypes)
    assert all("over a 128-wide layer" in line for line in lines)


def test_cli_takes_the_device() -> None:
    args = build_parser().parse_args(["calibrate", "--device", "cpu", "--out", "x.json"])
    assert args.device == "cpu"
    assert build_parser().parse_args(["calibrate"]).device == "auto"  # as the engine's --device


@pytest.mark.parametrize("ranks", [1, 2])
def test_host_overhead_is_a_cost_a_step_and_a_layer(ranks: int) -> None:
    """Decode steps of the two tiny models through the real engine, one rank or two
    sharing this host (rank 0 leads each step): a step of the larger model costs the
    host some time, never nothing, and neither term is absurd. (The split between the
    two terms is a difference of two timings, which a busy machine can drive to 0.)"""
    from ctxpar.entrypoints.cli.calibrate_host import LAYERS, host_overhead

    step, layer = host_overhead("fp32", torch.device("cpu"), ranks, None if ranks == 1 else 1)
    assert 0 <= layer < 5e-3 and 0 <= step < 0.1 and step + LAYERS[1] * layer > 1e-5, (step, layer)


def test_a_lead_is_the_rank_with_every_core(monkeypatch) -> None:
    """lead_profile measures the rates again with more threads, takes the host's cost of a
    led step from host_overhead for that many ranks (measured through real engines by the
    test above; here what it returns is recorded), and keeps everything else of the
    rank's profile (its link, dtype); the rank's threads come back."""
    import dataclasses

    from ctxpar.costmodel import load_hardware

    small_rank_figures(monkeypatch)
    asked = []
    host_overhead = lambda *args: asked.append(args) or ((1.5e-3, 16e-6) if args[0] == "fp32" else (2.5e-3, 90e-6))
    before = torch.get_num_threads()
    rank = dataclasses.replace(load_hardware("cpu-core-shm"), lead=None)
    lines: list[str] = []
    lead = cal.lead_profile(rank, before, 2, lines.append, host_overhead)
    assert torch.get_num_threads() == before
    assert (lead.notes["threads"], lead.notes["ranks"]) == (2 * before, 2)
    measured = lead.rates.get
    assert (lead.gemm_flops, lead.weight_read_bandwidth) == (
        measured("gemm_flops", "fp32"),
        measured("weight_read_bandwidth", "fp32"),
    )
    assert lead.with_weight_dtype("q4").gemm_flops == measured("gemm_flops", "q4")
    assert lead.kv_read_bandwidth == measured(KV, "fp32") and measured(KV, "bf16") is not None
    assert any("a step led for 2 ranks" in line for line in lines)
    assert asked == [("fp32", cal.CPU, 2, before), ("bf16", cal.CPU, 2, before)]
    assert (lead.step_overhead_s, lead.layer_overhead_s) == (1.5e-3, 16e-6)
    bf16 = lead.with_activation_dtype("bf16")
    assert (bf16.step_overhead_s, bf16.layer_overhead_s) == (2.5e-3, 90e-6)
    assert lead.elementwise_bandwidth == measured("elementwise_bandwidth", "fp32")
    assert lead.attention_flops == measured("attention_flops", "fp32")
    assert lead.with_activation_dtype("bf16").attention_flops == measured("attention_flops", "bf16")
    rates = ("gemm_flops", "attention_flops", "memory_bandwidth", "weight_read_bandwidth", "kv_read_bandwidth")
    rates += ("elementwise_bandwidth",)
    assert all(0 < getattr(lead, r) < math.inf for r in rates)
    host = ("step_overhead_s", "layer_overhead_s")
    same = {f.name for f in dataclasses.fields(rank)} - {*rates, *host, "name", "description", "rates", "notes"}
    assert all(getattr(lead, f) == getattr(rank, f) for f in same)
    assert dataclasses.replace(rank, lead=lead).led(True) is lead
