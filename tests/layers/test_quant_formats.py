"""Q3_K, IQ4_NL and IQ4_XS blocks built field by field from chosen integers and scales
(ggml-common.h's layouts, written here independently of the decoders), decoded by
layers/quant_blocks.py into the integers and scales chosen, and dequantized to the
floats of the gguf package's dequantizer, exactly. (Random blocks of every format
against gguf, the kernel against float64 and batch invariance: tests/kernels/test_quant.py
and test_batch_invariance.py, parametrized over every kept format.)"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL
from gguf.quants import dequantize as gguf_dequantize

from ctxpar.layers.quant_blocks import FORMATS, decode, dequantize
from ctxpar.layers.quant_linear import QuantWeight

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


def test_q2_k_is_not_a_kept_format() -> None:
    """Q2_K's minimum is one per 16 weights, an offset no kernel layout holds (one per 32):
    it is not decoded into one (models/gguf.py dequantizes it to float32 instead)."""
    assert "Q2_K" not in FORMATS
    with pytest.raises(KeyError):
        decode(np.zeros((1, 84), np.uint8), "Q2_K", 256)
