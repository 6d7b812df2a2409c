"""GGUF block decoders and the quantized-weight kernels, against outside references.

- decoders (layers/quant_blocks.py): random blocks of every format with
  finite fp16 scales, bit for bit against the gguf package's dequantizer;
- the kernel layout (layers/quant_linear.py): repacked and dequantized (by
  the C++ kernel and by the PyTorch path) it is still gguf's floats exactly;
- the integer kernel (kernels/quant_gemv.cpp): against float64 products, for
  the AVX2 build of this CPU and a build without AVX2 (its scalar loop).
  Two references: the weights times the activations as the kernel quantizes
  them (float64: only the kernel's float32 sums differ, ~1e-6 relative), and
  the exact product within the bound of that quantization's rounding,
  max|x| / 254 per block times the block's sum of |w|;
- a scale or an offset changed by one part in a thousand fails those checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ctxpar import kernels
from ctxpar.layers import quant_linear
from ctxpar.layers.quant_blocks import FORMATS, decode, dequantize
from ctxpar.layers.quant_linear import QuantWeight, concat
from ctxpar.machine import cpu_info
from helpers.gguf_blocks import random_blocks
from helpers.kernel_builds import VNNI_BUILD

ALL = sorted(FORMATS)


def reference(raw: np.ndarray, name: str) -> np.ndarray:
    return gguf_dequantize(raw, GGMLQuantizationType[name])


@pytest.mark.parametrize("name", ALL)
def test_decoders_match_gguf_bit_for_bit(name: str) -> None:
    rng = np.random.default_rng(ALL.index(name))
    for rows, cols in [(1, FORMATS[name].block), (7, 512), (3, 1536)]:
        raw = random_blocks(name, rows, cols, rng)
        want = reference(raw, name).reshape(rows, cols)
        got = dequantize(decode(raw, name, cols))
        assert got.dtype == np.float32 and np.array_equal(got, want), name


@pytest.mark.parametrize("name", ALL)
def test_kernel_layout_keeps_every_weight(name: str) -> None:
    """Repacked for the kernel, each weight sits where the kernel reads it: its dequantization
    (C++ and PyTorch) is gguf's, exactly, and the layout decodes back to the same integers
    (Q4_0's less its zero, 8, which stands for its offsets of -8 scales)."""
    rng = np.random.default_rng(100 + ALL.index(name))
    raw = random_blocks(name, 9, 768, rng)
    decoded = decode(raw, name, 768)
    w = QuantWeight.from_decoded(decoded)
    assert w.bits == (4 if FORMATS[name].bits in (2, 4) else 8) and w.shape == (9, 768)  # Q2_K's as nibbles
    assert np.array_equal(w.decoded().q.astype(np.int16) + w.zero, decoded.q)
    want = torch.from_numpy(reference(raw, name).reshape(9, 768))
    assert torch.equal(w.dequantize(), want)
    assert torch.equal(w.dequantize(2, 7), want[2:7])
    assert torch.equal(w.rows(3, 8).dequantize(), want[3:8])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CTXPAR_KERNELS", "0")
        assert torch.equal(w.dequantize(), want)


@pytest.mark.parametrize("name", ALL)
def test_layout_from_the_files_bytes_is_the_decoded_layout(name: str) -> None:
    """``from_blocks`` copies Q4_0, Q4_1 and Q8_0 fields out of the file's bytes as they
    are (and decodes the rest): the same tensors, dtypes and values as the decoded path.
    Q4_0 keeps its form (zero 8, no offsets), a scale whose -8 d is past float16's
    range included."""
    rng = np.random.default_rng(200 + ALL.index(name))
    raw = random_blocks(name, 5, 512, rng)
    cases = [raw]
    if name == "Q4_0":
        big = raw.copy()
        big[0, 0:2] = np.array([10000.0], dtype=np.float16).view(np.uint8)
        cases.append(big)
    for r in cases:
        got, want = QuantWeight.from_blocks(r, name, 512), QuantWeight.from_decoded(decode(r, name, 512))
        assert (got.bits, got.group) == (want.bits, want.group)
        assert got.zero == want.zero == (8 if name == "Q4_0" else 0)
        for a, b in zip(got.tensors(), want.tensors(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_concat_widens_without_changing_a_weight() -> None:
    """A fused projection whose parts differ in format (Q4_K rows and Q6_K rows, as
    llama.cpp's Q4_K_M files mix them) joins at 8 bits and groups of 16."""
    rng = np.random.default_rng(7)
    parts = {n: random_blocks(n, 4, 512, rng) for n in ("Q4_K", "Q6_K", "Q8_0")}
    joined = concat([QuantWeight.from_decoded(decode(raw, n, 512)) for n, raw in parts.items()])
    assert (joined.bits, joined.group) == (8, 16)
    want = np.concatenate([reference(raw, n).reshape(4, 512) for n, raw in parts.items()])
    assert torch.equal(joined.dequantize(), torch.from_numpy(want))


@pytest.fixture(params=["native", *VNNI_BUILD, "haswell", "x86-64"])
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """This CPU's build (AVX-512 VNNI's tiles, with AMX where the CPU has it), on a
    CPU with AMX the build for one without (cascadelake), the AVX2 build and one
    without AVX2, whose scalar loop CPUs without it run."""
    if request.param != "native":
        lib = kernels._library(request.param)
        assert lib is not None
        monkeypatch.setattr(kernels, "_library", lambda march="native": lib)
    return request.param


def quantized_activations(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x (n, in) float32 as the kernel sees it: per block of 32 (16 against a ``spread``
    weight, Q2_K's), d = max|x| / 127 and q = round-half-even(x * (1 / d)) in float32;
    returns d * q in float64."""
    blocks = x.reshape(x.shape[0], -1, block)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv)
    return (d.astype(np.float64) * q).reshape(x.shape)


def check(y: torch.Tensor, x: np.ndarray, w: np.ndarray, bias: np.ndarray, block: int = 32) -> None:
    """y (n, out) against x (n, in) @ w (out, in)^T + bias in float64: within float32
    summation error of the product with the kernel's activations, and within the
    activations' rounding bound of the exact product."""
    w64 = w.astype(np.float64)
    emulated = quantized_activations(x, block) @ w64.T + bias
    magnitude = np.abs(quantized_activations(x, block)) @ np.abs(w64).T + np.abs(bias)
    assert np.all(np.abs(y.numpy() - emulated) <= 2e-6 * magnitude + 1e-30), "kernel vs emulated activations"
    exact = x.astype(np.float64) @ w64.T + bias
    step = np.abs(x.reshape(x.shape[0], -1, 32)).max(-1) / 254.0  # (n, in/32): half a quantization step
    bound = step @ np.abs(w64).reshape(w.shape[0], -1, 32).sum(-1).T  # (n, out)
    assert np.all(np.abs(y.numpy() - exact) <= bound * (1 + 1e-4) + 2e-6 * magnitude), "kernel vs exact product"


@pytest.mark.parametrize("name", ALL)
def test_kernel_matches_float64_product(name: str, build: str) -> None:
    rng = np.random.default_rng(200 + ALL.index(name))
    # Up to 15 rows: the VNNI loop; 16 and more: AMX's groups of 16 (where the CPU has it), then the loop.
    shapes = [(1, 1, 256), (1, 37, 512), (3, 64, 1536), (5, 19, 256), (9, 8, 768), (16, 33, 256), (37, 18, 512)]
    if FORMATS[name].block == 32:  # rows of 3, 7 and 10 blocks: an odd last block, fewer than 8 after the last 8
        shapes += [(2, 5, 96), (1, 7, 224), (4, 3, 320)]
    for n, out, cols in shapes:
        raw = random_blocks(name, out, cols, rng)
        w = QuantWeight.from_decoded(decode(raw, name, cols))
        weights = reference(raw, name).reshape(out, cols)
        x = (rng.standard_normal((n, cols)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32)
        x[:, :32] = 0  # an all-zero block: d = 0
        bias = rng.standard_normal(out).astype(np.float32)
        b = torch.from_numpy(bias)
        y = quant_linear.quant_linear(torch.from_numpy(x), w, b)
        check(y, x, weights, bias.astype(np.float64), 16 if w.spread else 32)


def test_strided_rows() -> None:
    """Token rows with a stride (views the layers pass), one row and many alike."""
    rng = np.random.default_rng(5)
    raw = random_blocks("Q4_1", 1100, 256, rng)  # more rows than one tile
    w = QuantWeight.from_decoded(decode(raw, "Q4_1", 256))
    weights = reference(raw, "Q4_1").reshape(1100, 256)
    for n in (3, 40):
        wide = torch.randn(n, 300)
        x = wide[:, 10:266]  # rows 300 floats apart
        check(quant_linear.quant_linear(x, w), x.contiguous().numpy(), weights, np.zeros(1100))


@pytest.mark.parametrize("name", ALL)
def test_scales_kept_as_halves_where_exact(name: str) -> None:
    """The blocks of 32's scales and offsets are the file's fp16 fields: they stay halves
    (Q4_1: 16 + 2 + 2 bytes a block of 32, as in the file); the super-blocks' (K-quants,
    IQ4_XS) are products of two scales, which need float32 to stay exact."""
    w = QuantWeight.from_decoded(decode(random_blocks(name, 4, 256, np.random.default_rng(3)), name, 256))
    legacy = FORMATS[name].block == 32
    assert w.scales.dtype == (torch.float16 if legacy else torch.float32)
    assert w.offsets is None or w.offsets.dtype == w.scales.dtype
    if name == "Q4_1":
        assert w.nbytes() == 4 * 256 // 32 * 20


@pytest.mark.parametrize("field", ["scale", "offset"])
@pytest.mark.parametrize("name", ["Q4_K", "Q4_1"])  # float32 and half scales
def test_a_changed_scale_or_offset_fails(field: str, name: str) -> None:
    """The checks above are tight enough to see one scale or one offset of one block off
    by one part in a thousand."""
    rng = np.random.default_rng(11)
    raw = random_blocks(name, 16, 512, rng)
    w = QuantWeight.from_decoded(decode(raw, name, 512))
    weights = reference(raw, name).reshape(16, 512)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    target = w.scales if field == "scale" else w.offsets
    assert target is not None
    target.view(-1)[target.abs().argmax()] *= 1.001  # the largest: a block whose weights count
    y = quant_linear.quant_linear(torch.from_numpy(x), w)
    with pytest.raises(AssertionError):
        check(y, x, weights, np.zeros(16))


IN_PLACE = ["Q4_0", "Q4_1", "Q8_0"]  # the formats whose blocks the kernels read where a file holds them


def mapped(raw: np.ndarray) -> np.ndarray:
    """raw's bytes as a file's read-only memory map holds them (what GGUFFile hands out)."""
    view = raw.copy()
    view.flags.writeable = False
    return view


@pytest.mark.parametrize("name", IN_PLACE)
def test_blocks_in_place_compute_the_copied_layouts_bits(name: str, build: str) -> None:
    """A GGUF tensor's blocks read where they lie (fields interleaved a block apart) give
    exactly the bits of the same blocks copied into ctxpar's own layout: the same integers,
    scales and float steps, through strides. Every row count (a decode step's direct
    reads, the VNNI loop, AMX's groups of 16), odd block counts, the dequantized rows."""
    rng = np.random.default_rng(300 + IN_PLACE.index(name))
    for out, cols in [(37, 512), (16, 96), (5, 224), (64, 1536)]:
        raw = random_blocks(name, out, cols, rng)
        copied = QuantWeight.from_blocks(raw, name, cols)
        placed = QuantWeight.in_place(mapped(raw), name)
        assert placed.mapped and placed.nbytes() == raw.nbytes  # its bytes are the file's, no more
        assert torch.equal(placed.dequantize(), copied.dequantize())
        assert torch.equal(placed.dequantize(3, 5), copied.dequantize(3, 5))
        for n in (1, 2, 3, 5, 16, 37):
            x = torch.from_numpy((rng.standard_normal((n, cols)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32))
            bias = torch.randn(out)
            assert torch.equal(quant_linear.quant_linear(x, placed, bias), quant_linear.quant_linear(x, copied, bias))


@pytest.mark.parametrize("name", IN_PLACE)
def test_parts_in_place_compute_the_joined_weights_bits(name: str, build: str) -> None:
    """A fused projection whose parts stay where they lie (QuantParts: one in place, one
    copied out, as a GGUF's V beside its un-permuted Q) gives the bits of the parts
    joined into one weight, each output beside the others'."""
    rng = np.random.default_rng(310 + IN_PLACE.index(name))
    raws = [random_blocks(name, rows, 256, rng) for rows in (48, 16, 21)]
    joined = concat([QuantWeight.from_blocks(raw, name, 256) for raw in raws])
    parts = quant_linear.QuantParts(
        [QuantWeight.in_place(mapped(raws[0]), name), QuantWeight.from_blocks(raws[1], name, 256)]
        + [QuantWeight.in_place(mapped(raws[2]), name)]
    )
    assert parts.shape == joined.shape
    bias = torch.randn(joined.out_features)
    for n in (1, 4, 19):
        x = torch.randn(n, 256)
        assert torch.equal(quant_linear.quant_linear(x, parts, bias), quant_linear.quant_linear(x, joined, bias))
    assert torch.equal(parts.dequantize(40, 70), joined.dequantize(40, 70))


@pytest.mark.parametrize("name", ALL)
def test_embedding_rows_are_ggufs(name: str, build: str) -> None:
    """An embedding's lookup (QuantWeight.take: the kernel reads the rows the ids name, in
    their order, repeats included) gives gguf's floats of those rows, for every format
    (Q2_K's spread slots too) and a file's blocks in place; ids outside the table, and a
    run of rows past it or backwards, are refused before any row is read."""
    rng = np.random.default_rng(360 + ALL.index(name))
    cols = FORMATS[name].block * 3
    raw = random_blocks(name, 40, cols, rng)
    want = torch.from_numpy(reference(raw, name).reshape(40, cols).astype(np.float32))
    tables = [QuantWeight.from_decoded(decode(raw, name, cols))]
    if name in IN_PLACE:
        tables.append(QuantWeight.in_place(mapped(raw), name))
    for table in tables:
        for ids in ([7], [39, 0, 7, 7, 12], list(range(40))):
            got = table.take(torch.tensor(ids))
            assert torch.equal(got, want[ids]), ids
        for bad in ([40], [-1], [3, 41]):
            with pytest.raises(ValueError, match="row ids"):
                table.take(torch.tensor(bad))
        for first, end in ((38, 41), (5, 3)):  # a run of rows, as the lm_head's tiles take them
            with pytest.raises(ValueError, match="not a run inside"):
                table.dequantize(first, end)


def test_a_moved_part_is_read_where_it_went() -> None:
    """Weights move after loading (onto huge pages, into the ranks' shared segment): the
    kernels then read the new place, also through a QuantParts, and never the old one."""
    rng = np.random.default_rng(320)
    raws = [random_blocks("Q4_0", 32, 256, rng) for _ in range(2)]
    parts = quant_linear.QuantParts([QuantWeight.from_blocks(raw, "Q4_0", 256) for raw in raws])
    x = torch.randn(3, 256)
    before = quant_linear.quant_linear(x, parts)
    moved = parts.parts[1]
    old = [moved.qs, moved.scales]
    moved.qs, moved.scales = moved.qs.clone(), moved.scales.clone()
    for t in old:
        t.zero_()  # the old place now holds other weights
    assert torch.equal(quant_linear.quant_linear(x, parts), before)


WIDE = ["Q4_0", "Q8_0", "Q4_1", "Q4_K", "Q6_K"]


@pytest.mark.parametrize("name", WIDE)
def test_wide_rows_and_many_rows_keep_each_rows_bits(name: str, build: str) -> None:
    """Rows wider than a tile holds at once (quant_tiles.h: 64 blocks a slice without AMX,
    the sums kept between slices) and more rows than a row block: each row's bits are its
    bits alone (a decode step's direct reads of the whole row), the outputs in pairs of
    tiles and a tile alone (53 = 3 x 16 + 5), and the values are the float64 product's.
    On the AVX2 build the many rows take the packed loop (quant_lanes.h; 8 bits as |q| by
    x with q's sign, Q6_K's two scales a block) and the one row the direct one."""
    rng = np.random.default_rng(330 + WIDE.index(name))
    out, cols = 53, 32 * (2 * 64 + 3) if not name.endswith("_K") else 256 * 17
    raw = random_blocks(name, out, cols, rng)
    w = (
        QuantWeight.in_place(mapped(raw), name)
        if name in IN_PLACE
        else QuantWeight.from_decoded(decode(raw, name, cols))
    )
    weights = reference(raw, name).reshape(out, cols)
    bias = rng.standard_normal(out).astype(np.float32)
    for n in (21, 600):  # 600: over a row block's 512 rows (~1 MB of codes over a slice's 2048 columns)
        x = (rng.standard_normal((n, cols)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32)
        y = quant_linear.quant_linear(torch.from_numpy(x), w, torch.from_numpy(bias))
        check(y, x, weights, bias.astype(np.float64))
        for r in (0, 7, 12, n - 1):
            alone = quant_linear.quant_linear(torch.from_numpy(x[r : r + 1]), w, torch.from_numpy(bias))
            assert torch.equal(alone, y[r : r + 1]), r


@pytest.mark.skipif("avx_vnni" not in cpu_info().flags, reason="this CPU cannot run an AVX-VNNI build")
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q3_K"])
def test_avx_vnni_build_computes_the_avx2_builds_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX-VNNI's dpbusd (the alderlake build) and AVX2's maddubs + madd (haswell) find the
    same integer sums, and the float steps are one code: the same bits, for a decode
    step's row and for more rows than a pass of the rows takes (quant_gemv.cpp: ~256 KB
    of codes, 60 rows at these 4,192 columns), the file's blocks in place and laid out.
    At 150 rows both builds pack every format's weights (8 bits: biased for dpbusd, as
    |q| by x with q's sign for maddubs; Q6_K's and Q3_K's two scales a block)."""
    rng = np.random.default_rng(340 + ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q3_K"].index(name))
    cols = 32 * 131 if not name.endswith("_K") else 256 * 17
    raw = random_blocks(name, 37, cols, rng)
    weights = [QuantWeight.from_decoded(decode(raw, name, cols))]
    if name in IN_PLACE:
        weights.append(QuantWeight.in_place(mapped(raw), name))
    x = torch.from_numpy((rng.standard_normal((150, cols)) * rng.uniform(0.1, 3, (150, 1))).astype(np.float32))
    bias = torch.randn(37)
    libs = {march: kernels._library(march) for march in ("haswell", "alderlake")}
    got = {}
    for march, lib in libs.items():
        assert lib is not None
        monkeypatch.setattr(kernels, "_library", lambda march="native", lib=lib: lib)
        got[march] = [quant_linear.quant_linear(x[:n], w, bias) for w in weights for n in (1, 3, 150)]
    assert all(torch.equal(a, b) for a, b in zip(got["haswell"], got["alderlake"], strict=True))
    check(got["haswell"][2], x.numpy(), reference(raw, name).reshape(37, cols), bias.numpy().astype(np.float64))
