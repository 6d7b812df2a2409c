"""The cost model's terms for q4 weights (GGUF's Q4_0 blocks), on pure inputs: the bytes
a step reads and the FLOPs it computes, counted here from the model's published numbers,
priced at the rates a profile measured for q4; and a profile calibrated once serving
every weight dtype (HardwareProfile.with_weight_dtype)."""

from __future__ import annotations

import dataclasses

import pytest

from ctxpar.costmodel import HardwareProfile, load_model_shape
from ctxpar.costmodel.timing import decode_time, prefill_time
from ctxpar.errors import CtxparError
from helpers.rates import rates

# Llama-3.2-1B's config.json, by hand: per layer Q and O (2048 x 32 x 64 each), K and V
# (2048 x 8 x 64 each), gate, up and down (2048 x 8192 each); the LM head tied to the embedding.
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 8192, 16, 32, 8, 64, 128256
LAYER_PARAMS = 2 * HIDDEN * HEADS * HEAD_DIM + 2 * HIDDEN * KV_HEADS * HEAD_DIM + 3 * HIDDEN * FFN
HEAD_PARAMS = VOCAB * HIDDEN
Q4_BYTES = 18 / 32  # a Q4_0 block: a half scale and 32 nibbles
KV_BYTES = 2 * KV_HEADS * HEAD_DIM * 4  # one token's K and V in one layer, fp32

# Rates chosen so each operation's bound is plain: a prefill's projections and attention
# are compute-bound, a decode step memory-bound.
Q4 = HardwareProfile(
    name="q4-rank",
    description="a CPU rank with Q4_0 weights, fp32 activations",
    gemm_flops=600e9,
    attention_flops=150e9,
    memory_bandwidth=20e9,
    memory_bytes=24 << 30,
    link_bandwidth=1e9,
    link_latency_s=1e-4,
    weight_dtype="q4",
    activation_dtype="fp32",
    weight_read_bandwidth=18e9,
)


def test_a_decode_step_reads_the_q4_weights_once_and_the_fp32_cache() -> None:
    m = load_model_shape("llama-3.2-1b")
    for context in (16, 2048):
        step = decode_time(m, Q4, context, 1, 1)
        weights = (LAYERS * LAYER_PARAMS + HEAD_PARAMS) * Q4_BYTES / Q4.weight_read_bandwidth
        kv = context * KV_BYTES * LAYERS / Q4.memory_bandwidth
        assert step.compute_s == 0 and step.memory_s == pytest.approx(weights + kv)


def test_a_decode_step_reads_its_cache_at_the_paged_kernel_rate() -> None:
    """A profile that measured the paged decode kernel's KV read (here a quarter of its
    memory rate) prices a decode step's cache at that rate: the step grows by the cache's
    bytes over the slower rate; its weights and a prefill cost what they did. A quantized
    cache, which that measurement is not of, is read at the memory rate."""
    m = load_model_shape("llama-3.2-1b")
    paged = dataclasses.replace(Q4, kv_read_bandwidth=5e9)
    weights = (LAYERS * LAYER_PARAMS + HEAD_PARAMS) * Q4_BYTES / Q4.weight_read_bandwidth
    for context in (16, 2048):
        kv = context * KV_BYTES * LAYERS
        assert decode_time(m, paged, context, 1, 1).memory_s == pytest.approx(weights + kv / 5e9)
        slower = decode_time(m, paged, context, 1, 1).total_s - decode_time(m, Q4, context, 1, 1).total_s
        assert slower == pytest.approx(kv / 5e9 - kv / Q4.memory_bandwidth)
        measured, memory_rate = (prefill_time(m, h, context, 0, 1, 1, 1, "gather") for h in (paged, Q4))
        assert measured == memory_rate
    int8_kv = 2 * KV_HEADS * HEAD_DIM + 4 * 2 * KV_HEADS  # a byte a value, a float32 scale per K or V head
    step = decode_time(m, paged.with_kv_cache_dtype("int8"), 2048, 1, 1)
    read = 2048 * int8_kv * LAYERS / Q4.memory_bandwidth
    attention = 2048 * 2 * HEADS * (2 * HEAD_DIM) * LAYERS / Q4.attention_flops  # the slower of the two counts
    assert step.compute_s + step.memory_s == pytest.approx(weights + max(read, attention))


def test_a_prefill_multiplies_every_token_at_the_q4_gemm_rate() -> None:
    m = load_model_shape("llama-3.2-1b")
    for tokens in (2048, 8192):
        ttft = prefill_time(m, Q4, tokens, 0, 1, 1, 1, "gather")
        linear = 2 * (LAYERS * LAYER_PARAMS * tokens + HEAD_PARAMS) / Q4.gemm_flops  # the LM head: the last token
        pairs = tokens * (tokens + 1) / 2
        attention = pairs * 2 * HEADS * (2 * HEAD_DIM) * LAYERS / Q4.attention_flops
        assert ttft.memory_s == 0 and ttft.compute_s == pytest.approx(linear + attention)


def test_one_calibration_prices_every_weight_dtype() -> None:
    """A profile calibrated for fp32 weights carries q4's measured rates in its rates:
    with_weight_dtype takes them (for its lead too) and changes nothing else; a dtype not
    measured is refused rather than priced at another's rates."""
    measured = rates(
        {("gemm_flops", "q4"): 600e9, ("weight_read_bandwidth", "q4"): 18e9, ("gemm_flops", "fp32"): 150e9}
    )
    lead_rates = rates({("gemm_flops", "q4"): 1100e9, ("weight_read_bandwidth", "q4"): 30e9})
    fp32 = dataclasses.replace(Q4, weight_dtype="fp32", gemm_flops=150e9, weight_read_bandwidth=15e9, rates=measured)
    fp32 = dataclasses.replace(fp32, lead=dataclasses.replace(fp32, name="lead", rates=lead_rates))
    q4 = fp32.with_weight_dtype("q4")
    assert (q4.weight_dtype, q4.gemm_flops, q4.weight_read_bandwidth) == ("q4", 600e9, 18e9)
    assert q4.lead is not None and (q4.lead.gemm_flops, q4.lead.weight_read_bandwidth) == (1100e9, 30e9)
    assert dataclasses.replace(q4, lead=None) == dataclasses.replace(Q4, rates=measured)
    assert fp32.with_weight_dtype("fp32") is fp32
    with pytest.raises(CtxparError, match="no rates for bf16 weights"):
        fp32.with_weight_dtype("bf16")


def test_a_model_reads_its_weights_at_the_rate_of_its_layers_width() -> None:
    """A profile with the weight read measured over a 2048- and a 4096-wide layer prices each
    model at the nearest width's rate (a 1B's 2048 and SmolLM2's 576 at the first, an 8B's
    4096 and a 70B's 8192 at the second), its lead too, and `estimate` uses it: the 8B's
    decode step is the step at that rate; a profile without such rates is priced as it was."""
    from ctxpar.costmodel import estimate

    widths = rates({("weight_read_bandwidth", "q4", 2048): 18e9, ("weight_read_bandwidth", "q4", 4096): 24e9})
    lead_widths = rates({("weight_read_bandwidth", "q4", 2048): 30e9, ("weight_read_bandwidth", "q4", 4096): 36e9})
    q4 = dataclasses.replace(Q4, rates=widths, lead=dataclasses.replace(Q4, name="lead", rates=lead_widths))
    for name, rate, lead in (
        ("smollm2-135m", 18e9, 30e9),
        ("llama-3.2-1b", 18e9, 30e9),
        ("llama-3-8b", 24e9, 36e9),
        ("llama-3-70b", 24e9, 36e9),
    ):
        priced = q4.for_model(load_model_shape(name))
        assert priced.weight_read_bandwidth == rate
        assert priced.lead is not None and priced.lead.weight_read_bandwidth == lead
    m = load_model_shape("llama-3-8b")
    [row] = estimate(m, q4, 2048, pcp=[1], dcp=[1])
    at_24 = decode_time(m, dataclasses.replace(Q4, weight_read_bandwidth=24e9), 2048, 1, 1)
    assert row.decode.total_s == pytest.approx(at_24.total_s) and at_24.total_s < decode_time(m, Q4, 2048, 1, 1).total_s
    assert Q4.for_model(m) == Q4
