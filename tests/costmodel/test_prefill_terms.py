"""The cost model's terms for a prefill's work beyond its projections and attention (the
elementwise steps: RMSNorms, residual adds, rope, SiLU·up, the KV cache's write), its rates
by the width of a model's layers, and the activation dtype's (bf16 attention on AMX tiles):
the values counted here by hand from the models' published numbers, the seconds derived
from a profile's rates, and `ctxpar calibrate` measuring those rates through the engine's
own kernels (at small sizes)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from ctxpar.costmodel import HardwareProfile, estimate, load_model_shape
from ctxpar.costmodel import hardware_calibration as cal
from ctxpar.costmodel.rates import Rates
from ctxpar.costmodel.timing import decode_time, prefill_time
from ctxpar.entrypoints.cli.main import main
from ctxpar.errors import CtxparError
from helpers.rates import rates

# Llama-3.2-1B's and Llama-3-8B's config.json, by hand: (hidden, MLP width, layers, heads, KV heads, head dim).
L1B = (2048, 8192, 16, 32, 8, 64)
L8B = (4096, 14336, 32, 32, 8, 128)


def by_hand(hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Values one token reads and writes in a Llama layer's elementwise steps, a pass each."""
    input_norm = hidden + hidden  # x read, its norm written
    post_norm = 4 * hidden  # a and h read, h (a + h) and its norm written
    joined = 2 * hidden  # the MLP's row chunks' outputs read, joined into one written
    residual = 3 * hidden  # h and the MLP's output read, h written
    silu_up = 2 * ffn + ffn  # gate and up read, their product written
    rope = 2 * (heads + kv_heads) * head_dim  # Q's and K's heads read and written in place
    kv_write = 2 * (2 * kv_heads * head_dim)  # the K and V entry read, then written into the cache
    return input_norm + post_norm + joined + residual + silu_up + rope + kv_write


def values(shape: tuple[int, ...]) -> int:
    hidden, ffn, _, heads, kv_heads, head_dim = shape
    return by_hand(hidden, ffn, heads, kv_heads, head_dim)


# A CPU rank: the projections and attention compute-bound at a prefill's rows.
RANK = HardwareProfile(
    name="rank",
    description="a CPU rank with Q4_0 weights, fp32 activations",
    gemm_flops=800e9,
    attention_flops=240e9,
    memory_bandwidth=30e9,
    memory_bytes=24 << 30,
    link_bandwidth=1e9,
    link_latency_s=1e-4,
    weight_dtype="q4",
    activation_dtype="fp32",
    weight_read_bandwidth=21e9,
)


def test_a_layers_elementwise_values_are_its_steps_passes() -> None:
    assert load_model_shape("llama-3.2-1b").elementwise_values == values(L1B)
    assert load_model_shape("llama-3-8b").elementwise_values == values(L8B)
    m = load_model_shape("llama-3-8b")
    assert m.elementwise_bytes(2.0) == 2 * values(L8B)


def test_an_moe_layer_counts_the_experts_a_token_goes_through() -> None:
    """DeepSeek-V3: its 3 dense layers' SiLU·up at the dense width, its 58 MoE layers' at its
    8 routed and 1 shared experts' (2048 each), averaged; rope over the rope dims of its 128
    query heads and its one roped key; the norms of its two latents."""
    hidden, dense, expert, layers, moe_layers, heads, rope = 7168, 18432, 2048, 61, 58, 128, 64
    q_rank, kv_rank = 1536, 512
    mlp = ((layers - moe_layers) * dense + moe_layers * 9 * expert) / layers
    expected = 11 * hidden + round(3 * mlp) + 2 * (q_rank + kv_rank) + 2 * (heads + 1) * rope + 2 * (kv_rank + rope)
    assert load_model_shape("deepseek-v3").elementwise_values == expected


@pytest.mark.parametrize("name, shape", [("llama-3.2-1b", L1B), ("llama-3-8b", L8B)])
def test_every_token_pays_the_elementwise_steps_at_the_calibrated_rate(name: str, shape: tuple[int, ...]) -> None:
    """A prefill grows by tokens/P x layers x the values' fp32 bytes over the rate, as memory
    traffic, at any P; a decode step by its rows'; a profile without the rate (the built-in
    ones) prices neither."""
    m = load_model_shape(name)
    rate = 11e9
    measured = dataclasses.replace(RANK, elementwise_bandwidth=rate)
    layers = shape[2]
    for tokens, pcp in ((2048, 1), (8192, 1), (8192, 2)):
        without = prefill_time(m, RANK, tokens, 0, 1, pcp, 1, "gather")
        with_it = prefill_time(m, measured, tokens, 0, 1, pcp, 1, "gather")
        grown = tokens / pcp * layers * values(shape) * 4 / rate
        assert with_it.memory_s - without.memory_s == pytest.approx(grown)
        assert with_it.total_s - without.total_s == pytest.approx(grown)
    for batch in (1, 8):
        grown = batch * layers * values(shape) * 4 / rate
        step = decode_time(m, measured, 2048, batch, 1).total_s - decode_time(m, RANK, 2048, batch, 1).total_s
        assert step == pytest.approx(grown)


WIDTH_RATES = {
    ("weight_read_bandwidth", "q4", 2048): 21e9,
    ("weight_read_bandwidth", "q4", 4096): 24e9,
    ("gemm_flops", "q4", 2048): 800e9,
    ("gemm_flops", "q4", 4096): 650e9,
    ("elementwise_bandwidth", "fp32", 2048): 11e9,
    ("elementwise_bandwidth", "fp32", 4096): 9e9,
}


def test_a_model_is_priced_at_the_rates_of_its_layers_width() -> None:
    """The GEMM and elementwise rates measured over a 2048- and a 4096-wide layer, as the
    weight read: each model at the nearest width's (its lead too); the 8B's TTFT is the
    prefill at the 4096-wide layer's rates, derived here from them."""
    lead = dataclasses.replace(RANK, name="lead", rates=rates({k: 2 * v for k, v in WIDTH_RATES.items()}))
    profile = dataclasses.replace(RANK, rates=rates(WIDTH_RATES), lead=lead)
    for name, width in (("llama-3.2-1b", 2048), ("llama-3-8b", 4096), ("llama-3-70b", 4096)):
        priced = profile.for_model(load_model_shape(name))
        taken = (priced.gemm_flops, priced.weight_read_bandwidth, priced.elementwise_bandwidth)
        kinds = (("gemm_flops", "q4"), ("weight_read_bandwidth", "q4"), ("elementwise_bandwidth", "fp32"))
        assert taken == tuple(WIDTH_RATES[(kind, dtype, width)] for kind, dtype in kinds)
        assert priced.lead is not None and priced.lead.gemm_flops == 2 * priced.gemm_flops
    m = load_model_shape("llama-3-8b")
    [row] = estimate(m, profile, 2048, pcp=[1], dcp=[1])
    hidden, ffn, layers, heads, kv_heads, head_dim = L8B
    layer_params = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * ffn
    head = 128256 * hidden
    linear = 2 * (layers * layer_params * 2048 + head) / 650e9
    attention = 2048 * 2049 / 2 * 2 * heads * 2 * head_dim * layers / RANK.attention_flops
    elementwise = 2048 * layers * values(L8B) * 4 / 9e9
    assert row.ttft.compute_s == pytest.approx(linear + attention)
    assert row.ttft.memory_s == pytest.approx(elementwise)


BF16_RATES = {("attention_flops", "fp32"): 240e9, ("attention_flops", "bf16"): 650e9}
BF16_RATES |= {("kv_read_bandwidth", "bf16"): 14e9, ("elementwise_bandwidth", "bf16"): 7e9}
BF16_RATES |= {("kv_read_bandwidth", "fp32"): 12e9, ("elementwise_bandwidth", "fp32"): 11e9}


def test_bf16_activations_take_the_bf16_rates() -> None:
    """with_activation_dtype: the attention (AMX tiles' rate), KV read and elementwise rates
    measured in bf16, bytes at 2 a value, the weights as they were, its lead alike; the
    prefill's attention at the bf16 rate; a dtype not measured is refused."""
    fp32 = dataclasses.replace(RANK, kv_read_bandwidth=12e9, elementwise_bandwidth=11e9, rates=rates(BF16_RATES))
    fp32 = dataclasses.replace(fp32, lead=dataclasses.replace(fp32, name="lead"))
    bf16 = fp32.with_activation_dtype("bf16")
    assert (bf16.activation_dtype, bf16.attention_flops) == ("bf16", 650e9)
    assert (bf16.kv_read_bandwidth, bf16.elementwise_bandwidth, bf16.act_bytes) == (14e9, 7e9, 2.0)
    assert (bf16.weight_dtype, bf16.gemm_flops) == ("q4", RANK.gemm_flops)
    assert bf16.lead is not None and bf16.lead.attention_flops == 650e9
    assert fp32.with_activation_dtype("fp32") is fp32
    m = load_model_shape("llama-3.2-1b")
    hidden, ffn, layers, heads, kv_heads, head_dim = L1B
    pairs = 2048 * 2049 / 2
    attention = pairs * 2 * heads * 2 * head_dim * layers
    ttft = {h.activation_dtype: prefill_time(m, h, 2048, 0, 1, 1, 1, "gather") for h in (fp32, bf16)}
    gained = attention / 240e9 - attention / 650e9
    elementwise = 2048 * layers * values(L1B) * (4 / 11e9 - 2 / 7e9)
    assert ttft["fp32"].total_s - ttft["bf16"].total_s == pytest.approx(gained + elementwise)
    with pytest.raises(CtxparError, match="no attention rate for bf16"):
        RANK.with_activation_dtype("bf16")


def test_estimate_prices_the_engines_dtype(tmp_path: Path, capsys) -> None:
    """`ctxpar estimate --dtype bfloat16`: a config.json model's weights and its activations in
    bf16 at the rates the profile holds for them."""
    measured = rates(BF16_RATES | {("gemm_flops", "bf16"): 500e9, ("weight_read_bandwidth", "bf16"): 20e9})
    fp32 = dataclasses.replace(RANK, weight_dtype="fp32", kv_read_bandwidth=12e9, rates=measured)
    path = tmp_path / "profile.json"
    path.write_text(fp32.to_json())
    argv = ["estimate", "--model", "llama-3.2-1b", "--hardware", str(path), "--context", "2048", "--pcp", "1"]
    assert main([*argv, "--dtype", "bfloat16", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    bf16 = dataclasses.replace(
        fp32,
        weight_dtype="bf16",
        activation_dtype="bf16",
        gemm_flops=500e9,
        weight_read_bandwidth=20e9,
        attention_flops=650e9,
        kv_read_bandwidth=14e9,
        elementwise_bandwidth=7e9,
    )
    m = load_model_shape("llama-3.2-1b")
    assert row["ttft_s"] == pytest.approx(prefill_time(m, bf16, 2048, 0, 1, 1, 1, "gather").total_s)
    assert row["decode_ms"] == pytest.approx(1e3 * decode_time(m, bf16, 2048, 1, 1).total_s)
    assert main([*argv, "--dtype", "bfloat16"]) == 0 and "bf16 activations" in capsys.readouterr().out
    assert main([*argv, "--dtype", "bfloat16", "--hardware", "h100x8-ib"]) == 0  # bf16 already: unchanged


SMALL_CONFIG = {"intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64}
SMALL_LAYERS = (
    (64, SMALL_CONFIG | {"hidden_size": 64, "num_key_value_heads": 2}),
    (128, SMALL_CONFIG | {"hidden_size": 128, "num_key_value_heads": 2, "head_dim": 64}),
)


def test_calibrate_times_the_elementwise_steps_and_bf16_attention(monkeypatch) -> None:
    """The elementwise rate of each activation dtype over each width's layer, through the
    engine's kernels (small here), the first width's the dtype's own; attention in each dtype
    through the kernel the engine runs: bf16 on AMX's tiles where the CPU has them."""
    from ctxpar import kernels

    monkeypatch.setattr(cal, "BUDGET_S", 0.02)
    monkeypatch.setattr(cal, "ELEMENTWISE_LAYERS", SMALL_LAYERS)
    monkeypatch.setattr(cal, "ELEMENTWISE_TOKENS", 64)
    monkeypatch.setattr(cal, "ATTN_SHAPE", (64, 4, 32))
    lines: list[str] = []
    rates = {(r.kind, r.dtype, r.hidden): r.value for r in cal.elementwise_rates(lines.append).measured}
    kind = "elementwise_bandwidth"
    assert set(rates) == {(kind, d, w) for w in (None, 64, 128) for d in ("fp32", "bf16")}
    assert all(0 < r < math.inf for r in rates.values()) and len(lines) == 2
    assert all(rates[(kind, d, None)] == rates[(kind, d, 64)] for d in ("fp32", "bf16"))
    attention = cal.attention_rates(cal.CPU, lines.append)
    assert {(r.kind, r.dtype) for r in attention.measured} == {("attention_flops", "fp32"), ("attention_flops", "bf16")}
    amx = kernels.available() and bool(kernels.loaded().prefill_attention_bf16_supports(32, 32))
    assert ("AMX tiles" in lines[-1]) == amx and "fp32 kernel" in lines[-2]


def test_a_calibrated_profile_carries_the_new_rates_and_estimate_adds_them(monkeypatch, tmp_path: Path) -> None:
    """calibrate() end to end at small sizes (the collectives and the host's cost recorded, not
    measured): the profile's elementwise rate is its activation dtype's, its rates hold
    every width's GEMM and elementwise rates and bf16's attention; and the TTFT `estimate`
    gives for the 1B grows, over the same profile without the elementwise rate, by the 1B's
    values x tokens x layers over the rate its width picks."""
    monkeypatch.setattr(cal, "BUDGET_S", 0.02)
    for name, small in (
        ("GEMM_SHAPES", [(64, 64, 64)]),
        ("ATTN_SHAPE", (64, 4, 16)),
        ("KV_SHAPE", (256, 8, 2, 64)),
        ("READ_BYTES", 1 << 20),
        ("WEIGHT_LAYERS", ((2048, [(64, 128)]), (4096, [(128, 128)]))),
        ("ELEMENTWISE_LAYERS", ((2048, SMALL_LAYERS[0][1]), (4096, SMALL_LAYERS[1][1]))),
        ("ELEMENTWISE_TOKENS", 64),
    ):
        monkeypatch.setattr(cal, name, small)
    monkeypatch.setattr(cal, "collective_costs", lambda: {"shm_latency_s": 2e-5, "shm_bandwidth": 5e9})
    monkeypatch.setattr(cal, "usable_cores", lambda: 1)  # one rank on this host: no lead to measure
    threads = torch.get_num_threads()
    try:
        host = lambda dtype, *args: (5e-4, 2e-5) if dtype == "fp32" else (9e-4, 7e-5)  # bf16 steps: no compiled loop
        profile = cal.calibrate(threads, "q4", "shm", lambda line: None, host)
    finally:
        torch.set_num_threads(threads)
    measured = {(r.kind, r.dtype, r.hidden): r.value for r in profile.rates.measured}
    assert profile.elementwise_bandwidth == measured[("elementwise_bandwidth", "fp32", None)] > 0
    assert {("gemm_flops", "q4", w) for w in (2048, 4096)} <= measured.keys()
    assert {("elementwise_bandwidth", d, w) for d in ("fp32", "bf16") for w in (2048, 4096)} <= measured.keys()
    assert measured[("attention_flops", "bf16", None)] > 0
    assert profile.attention_flops == measured[("attention_flops", "fp32", None)]
    assert (profile.step_overhead_s, profile.layer_overhead_s) == (5e-4, 2e-5)
    bf16 = profile.with_activation_dtype("bf16")
    assert (bf16.step_overhead_s, bf16.layer_overhead_s) == (9e-4, 7e-5)
    assert bf16.attention_flops == measured[("attention_flops", "bf16", None)]
    m = load_model_shape("llama-3.2-1b")
    without = dataclasses.replace(profile, elementwise_bandwidth=0.0, rates=Rates())
    without = dataclasses.replace(without, gemm_flops=measured[("gemm_flops", "q4", 2048)])
    without = dataclasses.replace(without, weight_read_bandwidth=measured[("weight_read_bandwidth", "q4", 2048)])
    [row] = estimate(m, profile, 2048, pcp=[1], dcp=[1])
    [base] = estimate(m, without, 2048, pcp=[1], dcp=[1])
    grown = 2048 * L1B[2] * values(L1B) * 4 / measured[("elementwise_bandwidth", "fp32", 2048)]
    assert row.ttft_s - base.ttft_s == pytest.approx(grown)


def test_a_prefills_rates_are_its_calls_median(monkeypatch) -> None:
    """best_time keeps the fastest call, typical_time (the GEMM's and attention's) the median:
    a call of each of these durations after the warm-up's, timed by a clock that reads them."""
    durations = iter([9.0, 0.5, 0.2, 0.4, 0.3, 0.1] * 2)  # the first of each six: the warm-up
    now = [0.0]
    monkeypatch.setattr(cal.time, "perf_counter", lambda: now[0])

    def call() -> None:
        now[0] += next(durations)

    assert cal.best_time(call, budget_s=0.0, min_runs=5) == pytest.approx(0.1)
    assert cal.typical_time(call, budget_s=0.0, min_runs=5) == pytest.approx(0.3)
