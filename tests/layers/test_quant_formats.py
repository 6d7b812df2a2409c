"""Q2_K, Q3_K, IQ4_NL and IQ4_XS blocks built field by field from chosen integers and scales
(ggml-common.h's layouts, written here independently of the decoders), decoded by
layers/quant_blocks.py into the integers and scales chosen, and dequantized to the
floats of the gguf package's dequantizer, exactly. (Random blocks of every format
against gguf, the kernel against float64 and batch invariance: tests/kernels/test_quant.py
and test_batch_invariance.py, parametrized over every kept format.)"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL
from gguf.quants import dequantize as gguf_dequantize

from ctxpar.layers.quant_blocks import FORMATS, decode, dequantize
from ctxpar.layers.quant_linear import QuantWeight, concat, quant_linear
from helpers.gguf_blocks import random_blocks

KVALUES = np.array(IQ4_NL.kvalues, dtype=np.int8)  # the gguf package's codebook


def half(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float16).view(np.uint8)


def nibbles_of(idx: np.ndarray) -> np.ndarray:
    """32 indices -> 16 bytes: index i < 16 in byte i's low nibble, i >= 16 in byte i - 16's high."""
    return (idx[:16] | (idx[16:] << 4)).astype(np.uint8)


def check(raw: np.ndarray, fmt: str, q: np.ndarray, scales: np.ndarray) -> None:
    got = decode(raw.reshape(1, -1), fmt, q.size)
    assert np.array_equal(got.q[0], q) and np.array_equal(got.scales[0], scales) and got.offsets is None
    want = gguf_dequantize(raw.reshape(1, -1), GGMLQuantizationType[fmt]).reshape(-1)
    assert np.array_equal(dequantize(got)[0], want)
    assert np.array_equal(dequantize(got)[0], np.repeat(scales, q.size // scales.size) * q.astype(np.float32))
    kernel = QuantWeight.from_decoded(got)
    assert np.array_equal(kernel.dequantize().numpy()[0], want)


def test_iq4_nl_block() -> None:
    idx = np.concatenate([np.arange(16), np.arange(15, -1, -1)])  # every index, both nibbles
    raw = np.concatenate([half(0.375), nibbles_of(idx)])
    check(raw, "IQ4_NL", KVALUES[idx], np.array([0.375], np.float32))


def test_iq4_xs_super_block() -> None:
    ls = np.array([0, 9, 17, 31, 32, 40, 55, 63])  # 6-bit scales of the 8 sub-blocks (ls - 32 applied)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 16, 256)
    scales_h = np.array([sum(int(ls[j] >> 4) << (2 * j) for j in range(8))], dtype="<u2").view(np.uint8)
    scales_l = np.array([(ls[2 * j] & 15) | ((ls[2 * j + 1] & 15) << 4) for j in range(4)], dtype=np.uint8)
    qs = np.concatenate([nibbles_of(idx[32 * j : 32 * j + 32]) for j in range(8)])
    raw = np.concatenate([half(0.0625), scales_h, scales_l, qs])
    assert raw.size == FORMATS["IQ4_XS"].nbytes
    check(raw, "IQ4_XS", KVALUES[idx], np.float32(0.0625) * (ls - 32).astype(np.float32))


def test_q3_k_super_block() -> None:
    rng = np.random.default_rng(1)
    sc = rng.permutation(64)[:16]  # 6-bit scales of the 16 groups of 16, ends included below
    sc[:2] = (0, 63)
    q = rng.integers(-4, 4, 256)  # -4..3: low 2 bits of q + 4, and a high bit of 1 where q >= 0
    low, high = (q + 4) & 3, (q >= 0).astype(np.uint8)
    # Weight 128 h + 32 s + lane: its low bits are bits 2s, 2s + 1 of qs[32 h + lane],
    # its high bit is bit (weight // 32) of hmask[lane].
    qs = np.zeros(64, np.uint8)
    hmask = np.zeros(32, np.uint8)
    for i in range(256):
        h, s, lane = i // 128, (i % 128) // 32, i % 32
        qs[32 * h + lane] |= low[i] << (2 * s)
        hmask[lane] |= high[i] << (i // 32)
    scales = np.zeros(12, np.uint8)
    for j in range(16):
        scales[j % 8] |= (sc[j] & 15) << (4 * (j // 8))
        scales[8 + j % 4] |= (sc[j] >> 4) << (2 * (j // 4))
    raw = np.concatenate([hmask, qs, scales, half(-0.25)])
    assert raw.size == FORMATS["Q3_K"].nbytes
    check(raw, "Q3_K", q, np.float32(-0.25) * (sc - 32).astype(np.float32))


def q2_k_block(q: np.ndarray, sc: np.ndarray, m: np.ndarray, d: float, dmin: float) -> np.ndarray:
    """Q2_K's 84 bytes: scales[16] (a group's scale in the low nibble, its min in the high),
    qs[64] (weight 128 h + 32 s + lane in bits 2s, 2s + 1 of qs[32 h + lane]), d, dmin."""
    qs = np.zeros(64, np.uint8)
    for i in range(256):
        h, s, lane = i // 128, (i % 128) // 32, i % 32
        qs[32 * h + lane] |= q[i] << (2 * s)
    return np.concatenate([(sc | (m << 4)).astype(np.uint8), qs, half(d), half(dmin)])


def test_q2_k_super_block() -> None:
    """Q2_K: weight = d sc q - dmin m, a scale and a minimum per 16: decoded into q, the
    scales d sc and offsets -dmin m per 16, gguf's floats exactly, in the kernel's layout
    too (``spread``: 4-bit slots, each 16 weights at the head of a block of 32)."""
    rng = np.random.default_rng(2)
    q = rng.integers(0, 4, 256)
    sc, m = rng.integers(0, 16, 16), rng.integers(0, 16, 16)
    sc[:2], m[:2] = (0, 15), (15, 0)  # the nibbles' ends
    d, dmin = np.float32(np.float16(0.0377)), np.float32(np.float16(-0.0113))  # a negative dmin: kept as it is
    raw = q2_k_block(q, sc, m, d, dmin)
    assert raw.size == FORMATS["Q2_K"].nbytes
    got = decode(raw.reshape(1, -1), "Q2_K", 256)
    scales, offsets = d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    assert np.array_equal(got.q[0], q) and (got.group, got.offset_group) == (16, 16)
    assert np.array_equal(got.scales[0], scales) and got.offsets is not None
    assert np.array_equal(got.offsets[0], offsets)
    want = gguf_dequantize(raw.reshape(1, -1), GGMLQuantizationType.Q2_K).reshape(-1)
    assert np.array_equal(dequantize(got)[0], want)
    assert np.array_equal(want, np.repeat(scales, 16) * q.astype(np.float32) + np.repeat(offsets, 16))
    kernel = QuantWeight.from_decoded(got)
    assert kernel.spread and (kernel.bits, kernel.group, kernel.in_features, kernel.kernel_in) == (4, 32, 256, 512)
    assert np.array_equal(kernel.dequantize().numpy()[0], want)
    assert kernel.nbytes() == 256 * 1.5  # a nibble a slot (2 a weight), a float32 scale and offset per 16


def test_q2_k_rows_fused_with_other_formats_and_alone() -> None:
    """A fused projection of Q2_K rows and Q4_K and Q6_K rows (llama.cpp's Q2_K files mix
    them) keeps every weight (the others spread alike), and a row's product is the same
    bits computed alone or beside other rows, within the int8 activations' rounding
    (per 16, half a step of max|x| / 127) of the float64 product."""
    rng = np.random.default_rng(5)
    raws = {n: random_blocks(n, rows, 512, rng) for n, rows in (("Q2_K", 20), ("Q4_K", 8), ("Q6_K", 5))}
    parts = [QuantWeight.from_decoded(decode(raw, n, 512)) for n, raw in raws.items()]
    joined = concat(parts)
    want = np.concatenate([gguf_dequantize(raw, GGMLQuantizationType[n]).reshape(-1, 512) for n, raw in raws.items()])
    assert joined.spread and joined.shape == (33, 512)
    assert torch.equal(joined.dequantize(), torch.from_numpy(want))
    x = torch.from_numpy(rng.standard_normal((21, 512)).astype(np.float32))
    y = quant_linear(x, joined)
    for r in (0, 7, 20):
        assert torch.equal(quant_linear(x[r : r + 1], joined), y[r : r + 1])
    assert torch.equal(quant_linear(x[3:19], joined), y[3:19])  # 16 rows: AMX's group where the CPU has it
    exact = x.double().numpy() @ want.astype(np.float64).T
    step = np.abs(x.numpy().reshape(21, -1, 16)).max(-1) / 254.0  # half a step, per 16
    bound = step @ np.abs(want.astype(np.float64)).reshape(33, -1, 16).sum(-1).T
    assert np.all(np.abs(y.numpy() - exact) <= bound * (1 + 1e-4) + 1e-5)
