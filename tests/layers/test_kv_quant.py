"""The quantized KV cache's format (ctxpar/layers/kv_quant.py): round trips
against float64 within each format's rounding, scales that use the whole code
range, dequantize as the bytes say, and its size in bytes."""

from __future__ import annotations

import pytest
import torch

from ctxpar.config import EngineConfig
from ctxpar.errors import CtxparError
from ctxpar.layers.kv_quant import CODE_DTYPES, QMAX, KVQuant, default_runs, kv_bytes_per_token_per_layer
from helpers.attention_reference import assert_within, dequantize64, int8_bounds

# Per format: relative error of a normal value (half a unit in the last place),
# and the smallest normal code, below which the error is absolute (half the
# smallest subnormal step), both times the run's scale.
ROUNDING = {
    torch.int8: (0.0, float("inf")),  # uniform: |error| <= scale / 2 everywhere (a step of 1)
    torch.float8_e4m3fn: (2.0**-4, 2.0**-6),
    torch.float8_e5m2: (2.0**-3, 2.0**-14),
}
SUBNORMAL_STEP = {torch.int8: 1.0, torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}
# GQA (2 K/V x 3 heads of 64) and MLA-like (a latent of 32 and a rope key of 8: runs of two widths).
LAYOUTS = [((2, 3, 64), default_runs((2, 3, 64))), ((40,), (32, 8))]


def entries(n: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values over several orders of magnitude (fp8's subnormals reached), one run all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g) * torch.exp(2 * torch.randn(n, *shape, generator=g))
    x.view(n, -1)[0, :8] = 0.0  # part of a run: its scale comes from the rest
    x.view(n, -1)[1] = 0.0  # a whole token of zeros: scale 0, no NaN
    return x


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("shape, runs", LAYOUTS)
def test_round_trip_within_the_format_rounding(name, shape, runs) -> None:
    quant = KVQuant.of(name, shape, runs)
    x = entries(50, shape, seed=1)
    rows = quant.quantize(x)
    assert rows.shape == (50, quant.row_bytes) and rows.dtype == torch.uint8
    back = quant.dequantize(rows)
    assert back.shape == x.shape and back.dtype == torch.float32
    flat, got = x.reshape(50, -1).double(), back.reshape(50, -1).double()
    # The float64 reference of each run's scale: the largest magnitude over the largest code.
    amax = torch.stack([part.abs().amax(1) for part in flat.split(list(runs), dim=1)], dim=1)
    scale = (amax / QMAX[quant.codes]).repeat_interleave(torch.tensor(runs), dim=1)
    rel, normal = ROUNDING[quant.codes]
    bound = torch.where(flat.abs() >= normal * scale, rel * flat.abs(), SUBNORMAL_STEP[quant.codes] * scale / 2)
    assert ((got - flat).abs() <= bound * (1 + 1e-5) + 1e-30).all()
    assert (back.view(50, -1)[1] == 0).all()


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape, runs", LAYOUTS)
def test_scales_span_the_codes_and_dequantize_reads_the_bytes(name, shape, runs) -> None:
    """A scale too large would waste precision, too small would clip: each run's
    largest value maps to the largest code. And dequantize is the bytes' codes
    times their run's scale, exactly (a float64 reader of the layout agrees)."""
    quant = KVQuant.of(name, shape, runs)
    x = entries(20, shape, seed=2)
    rows = quant.quantize(x)
    want = x.reshape(20, -1).split(list(runs), dim=1)
    want = torch.stack([part.abs().amax(1) for part in want], dim=1) / QMAX[quant.codes]
    offset = quant.scale_offset
    torch.testing.assert_close(rows[:, offset:].contiguous().view(torch.float32), want, rtol=1e-6, atol=0)
    exact = dequantize64(rows, CODE_DTYPES[name], runs).float()
    assert torch.equal(quant.dequantize(rows).reshape(20, -1), exact)


def test_bytes_per_token() -> None:
    """SmolLM2's entry (2, 3, 64): 384 codes and 6 scales, against 1536 bytes in fp32."""
    shape = (2, 3, 64)
    assert kv_bytes_per_token_per_layer(shape, default_runs(shape), torch.float32, "model") == 1536
    assert kv_bytes_per_token_per_layer(shape, default_runs(shape), torch.bfloat16, "model") == 768
    for name in ("int8", "fp8", "fp8_e5m2"):
        assert kv_bytes_per_token_per_layer(shape, default_runs(shape), torch.float32, name) == 384 + 6 * 4
    # MLA (DeepSeek-V3): 512 + 64 codes, two scales.
    assert kv_bytes_per_token_per_layer((576,), (512, 64), torch.bfloat16, "int8") == 576 + 8


def test_unknown_kv_cache_dtype_names_the_allowed_ones() -> None:
    allowed = r"'auto', 'fp8', .*'int8', 'model'"
    with pytest.raises(CtxparError, match=rf"kv_cache_dtype must be one of {allowed}, got 'q4_0'"):
        EngineConfig(kv_cache_dtype="q4_0")


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape, runs", LAYOUTS)
def test_the_compiled_quantizer_writes_pytorchs_bytes(name, shape, runs) -> None:
    """The CPU kernel and PyTorch's ops (the path elsewhere) round alike, ties and
    the largest codes included: the same bytes, so ranks of either kind agree."""
    quant = KVQuant.of(name, shape, runs)
    x = entries(64, shape, seed=3)
    # Exact ties of the codes' grids: halfway between int8 steps and between fp8 neighbours.
    x.view(64, -1)[2, :4] = torch.tensor([127.0, 2.5, -0.5, 1.0 + 2.0**-4]) * x.view(64, -1)[2, :64].abs().max() / 127
    flat = x.reshape(64, -1)
    assert torch.equal(quant.quantize(x), quant.quantize_torch(flat))
    assert torch.equal(quant.quantize(x[::2]), quant.quantize_torch(flat[::2]))  # strided tokens


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_attending_cache_rows_equals_attending_their_entries(name) -> None:
    """GQA's attend_lse over quantized cache rows (DCP's shards: the compiled kernel reads
    them in place), each query over its own prefix of them, gives what it gives over the
    same rows dequantized first (int8: within the bound of its int16 codes)."""
    from ctxpar.kernels import attention_kernels
    from ctxpar.layers.attention.attend import GQA
    from ctxpar.layers.attention.backend import KERNELS

    shape = (2, 2, 64)
    quant = KVQuant.of(name, shape, default_runs(shape))
    rows = quant.quantize(torch.randn(13, *shape))
    q = torch.randn(5, 4, 64)
    counts = torch.tensor([1, 4, 4, 9, 13])
    assert attention_kernels.prefill_quant_usable(q, quant)
    gqa = GQA(0, 64, 0.125)
    out, lse = gqa.attend_lse(KERNELS, q, rows, counts, quant)
    kv, seen = quant.dequantize(rows), torch.arange(13)[None, :] < counts[:, None]
    want_out, want_lse = gqa.attend_lse(KERNELS, q, kv, counts, None)
    bound, lse_bound = int8_bounds(q, kv[:, 0], kv[:, 1], 0.125, seen) if name == "int8" else (0.0, 0.0)
    assert_within(out, want_out.double(), bound)
    assert_within(lse, want_lse.double(), lse_bound)
