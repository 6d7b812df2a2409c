"""GGUF quantized blocks decoded into one form: integers, a scale per group, an offset per 16 or 32.

Every block format ctxpar keeps quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the
K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_NL, IQ4_XS) stores a weight as
``scale * q + offset`` for a small integer q, with one scale per group of 16
or 32 weights and one offset (or none) per 32, or per 16 (Q2_K's minimum).
IQ4_NL and IQ4_XS store a 4-bit index into a 16-entry codebook of integers in
-127..113 (``IQ4_VALUES``): q is the codebook's integer, an int8, exact.
``decode`` turns a tensor's raw bytes into exactly that: q (int8), the scales
and the offsets as float32, computed the way llama.cpp's (and the gguf package's) dequantizers compute them, so
``dequantize`` (``scale * q`` then ``+ offset``, rounded once each, as they do)
gives their floats bit for bit. The kernel's layouts (layers/quant_linear.py)
are built from this form.

The formats (ggml-common.h): blocks of 32 for the legacy types, super-blocks
of 256 for the K-quants and IQ4_XS, fp16 scales; element i of a 4-bit block of 32 is
the low nibble of byte i (i < 16) or the high nibble of byte i - 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class Format:
    """A GGUF block type: weights and bytes per block, its q range, its group."""

    name: str
    block: int  # weights per block
    nbytes: int  # bytes per block
    bits: int  # q fits in an unsigned `bits`-bit integer once `zero` is added back
    zero: int  # q as decoded = stored integer - zero (signed for Q8_0, Q4_0, Q5_0, Q6_K)
    group: int  # weights per scale (16 for Q2_K, Q3_K, Q6_K, else 32)
    has_offset: bool  # an offset per 32 weights, or per group of 16 where the group is 16 (Q2_K)


FORMATS: dict[str, Format] = {
    "Q8_0": Format("Q8_0", 32, 34, 8, 128, 32, False),
    "Q4_0": Format("Q4_0", 32, 18, 4, 0, 32, True),  # offset -8 d: q stays 0..15, a nibble
    "Q4_1": Format("Q4_1", 32, 20, 4, 0, 32, True),
    "Q5_0": Format("Q5_0", 32, 22, 5, 16, 32, False),
    "Q5_1": Format("Q5_1", 32, 24, 5, 0, 32, True),
    "Q4_K": Format("Q4_K", QK_K, 144, 4, 0, 32, True),
    "Q5_K": Format("Q5_K", QK_K, 176, 5, 0, 32, True),
    "Q6_K": Format("Q6_K", QK_K, 210, 6, 32, 16, False),
    "Q3_K": Format("Q3_K", QK_K, 110, 3, 4, 16, False),
    "Q2_K": Format("Q2_K", QK_K, 84, 2, 0, 16, True),
    "IQ4_NL": Format("IQ4_NL", 32, 18, 8, 128, 32, False),  # q a codebook integer, -127..113
    "IQ4_XS": Format("IQ4_XS", QK_K, 136, 8, 128, 32, False),
}

# IQ4_NL's and IQ4_XS's codebook (ggml-common.h's kvalues_iq4nl): a 4-bit index's integer.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


@dataclass
class Decoded:
    """Weights ``scale * q + offset`` of a (rows, cols) tensor, groups along each row."""

    q: np.ndarray  # (rows, cols) int8
    scales: np.ndarray  # (rows, cols // group) float32
    offsets: np.ndarray | None  # (rows, cols // offset_group) float32, or None (all zero)
    group: int  # weights per scale: 16 or 32
    offset_group: int = 32  # weights per offset: 32, or 16 (Q2_K's minimum per group)


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 little-endian fp16 -> (n, 1) float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """(n, k * width / 2) bytes -> (n, k * width): per run of width/2 bytes, the low
    nibbles (width/2 weights), then the high ones."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, width // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (runs & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int, width: int) -> np.ndarray:
    """Bit `j` of each byte (j < count), for runs of `width` bytes: (n, runs * width)
    bytes -> (n, runs * count * width) 0/1, bit j's weights after bit j-1's."""
    n = qh.shape[0]
    shifts = np.arange(count, dtype=np.uint8).reshape(1, 1, count, 1)
    return ((qh.reshape(n, -1, 1, width) >> shifts) & np.uint8(1)).reshape(n, -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (n, 8) each:
    bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; bytes 8-11 hold the
    low nibbles of scales 4-7 and mins 4-7, whose top 2 bits are the top bits
    of bytes 0-3 and 4-7."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _shifts_2(count: int) -> np.ndarray:
    """Shifts 0, 2, 4, ... of `count` 2-bit fields of a byte, shaped to spread runs of bytes."""
    return (2 * np.arange(count, dtype=np.uint8)).reshape(1, 1, count, 1)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> 16 six-bit scales minus 32 (n, 16): bytes 0-7's low nibbles are
    scales 0-7's low 4 bits, their high nibbles 8-15's; bytes 8-11 hold the top 2 bits,
    bits 2k..2k+1 of byte 8 + j scale 4k + j's."""
    low = np.concatenate([s[:, :8] & 0x0F, s[:, :8] >> 4], axis=-1)
    high = ((s[:, 8:12].reshape(-1, 1, 4) >> _shifts_2(4)[0]) & np.uint8(3)).reshape(-1, 16)
    return (low | (high << np.uint8(4))).astype(np.int16) - 32


def _decode_blocks(fmt: Format, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(n, nbytes) blocks -> q (n, block) int, scales (n, block/group), offsets (n, block/32 or
    block/16) or None."""
    n = b.shape[0]
    if fmt.name == "Q8_0":
        return b[:, 2:].view(np.int8), _f16(b[:, :2]), None
    if fmt.name in ("Q4_0", "Q4_1"):
        d = _f16(b[:, :2])
        if fmt.name == "Q4_0":  # d (q - 8) = d q + (-8 d), both exact in float32
            return _nibbles(b[:, 2:], 32), d, d * np.float32(-8)
        return _nibbles(b[:, 4:], 32), d, _f16(b[:, 2:4])
    if fmt.name in ("Q5_0", "Q5_1"):
        start = 2 if fmt.name == "Q5_0" else 4
        qh = np.ascontiguousarray(b[:, start : start + 4]).view(np.uint32)  # (n, 1): bit i is weight i's 5th
        high = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
        q = _nibbles(b[:, start + 4 :], 32) | (high << np.uint8(4))
        if fmt.name == "Q5_0":
            return q.astype(np.int16) - 16, _f16(b[:, :2]), None
        return q, _f16(b[:, :2]), _f16(b[:, 2:4])
    if fmt.name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        scales, offsets = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
        if fmt.name == "Q4_K":  # 4 runs of 32 bytes: low nibbles = 32 weights, then high = the next 32
            return _nibbles(b[:, 16:], 64), scales, offsets
        q = _nibbles(b[:, 48:], 64) | (_high_bits(b[:, 16:48], 8, 32) << np.uint8(4))
        return q, scales, offsets
    if fmt.name == "Q6_K":
        low = _nibbles(b[:, :128], 128)  # 2 halves of 64 bytes -> 128 weights each
        high = ((b[:, 128:192].reshape(n, -1, 1, 32) >> _shifts_2(4)) & np.uint8(3)).reshape(n, -1)
        q = (low | (high << np.uint8(4))).astype(np.int16) - 32
        scales = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
        return q, scales, None
    if fmt.name == "Q3_K":  # hmask 32, qs 64, scales 12, d: q = low 2 bits - 4 where the hmask bit is 0
        low = ((b[:, 32:96].reshape(n, -1, 1, 32) >> _shifts_2(4)) & np.uint8(3)).reshape(n, -1)
        high = _high_bits(b[:, :32], 8, 32)
        q = low.astype(np.int16) - 4 * (1 - high.astype(np.int16))
        return q, _f16(b[:, 108:110]) * _q3_k_scales(b[:, 96:108]).astype(np.float32), None
    if fmt.name == "Q2_K":  # scales 16 (a group's scale in the low nibble, its min in the high), qs 64, d, dmin
        q = ((b[:, 16:80].reshape(n, -1, 1, 32) >> _shifts_2(4)) & np.uint8(3)).reshape(n, -1)  # Q3_K's low bits
        sc, d, dmin = b[:, :16], _f16(b[:, 80:82]), _f16(b[:, 82:84])
        return q, d * (sc & 0x0F).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32))
    if fmt.name == "IQ4_NL":  # d, then 16 bytes of indices as Q4_0's nibbles
        return IQ4_VALUES[_nibbles(b[:, 2:], 32)], _f16(b[:, :2]), None
    if fmt.name == "IQ4_XS":  # d, scales_h (2 bits a sub-block), scales_l (a nibble a sub-block), 8 x 16 bytes
        high = (b[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)
        low = _nibbles(b[:, 4:8], 2)  # byte j: sub-block 2j in its low nibble, 2j + 1 in its high
        ls = (low | (high.astype(np.uint8) << np.uint8(4))).astype(np.int16) - 32
        return IQ4_VALUES[_nibbles(b[:, 8:], 32)], _f16(b[:, :2]) * ls.astype(np.float32), None
    raise ValueError(f"no decoder for {fmt.name}")


def decode(raw: np.ndarray, fmt_name: str, cols: int) -> Decoded:
    """A GGUF tensor's bytes, (rows, cols / block * nbytes) uint8, as ``Decoded``."""
    fmt = FORMATS[fmt_name]
    if cols % fmt.block:
        raise ValueError(f"{fmt_name} rows of {cols} weights are not whole blocks of {fmt.block}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.size // (cols // fmt.block * fmt.nbytes)
    q, scales, offsets = _decode_blocks(fmt, raw.reshape(-1, fmt.nbytes))
    return Decoded(
        q=q.astype(np.int8).reshape(rows, cols),  # every format's q fits: -128..127
        scales=np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, cols // fmt.group),
        offsets=None if offsets is None else np.ascontiguousarray(offsets, dtype=np.float32).reshape(rows, -1),
        group=fmt.group,
        offset_group=fmt.group if fmt.has_offset else 32,
    )


def quantize_int8(w: np.ndarray, group: int = 32) -> Decoded:
    """Float weights (rows, cols) as int8 weight-only blocks (quantization="int8"): per group of
    ``group`` weights of a row, scale = max |w| / 127 and q = round(w / scale) in -127..127, no
    offset (Q8_0's form, with a float32 scale; a group, not a whole row, per scale: an outlier
    costs only its own 32 weights their precision, at 4 more bytes per 32)."""
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"int8 rows of {cols} weights are not whole groups of {group}")
    g = np.asarray(w, dtype=np.float32).reshape(rows, cols // group, group)
    scales = np.abs(g).max(axis=2) / np.float32(127)  # (rows, cols // group)
    safe = np.where(scales > 0, scales, np.float32(1))  # an all-zero group: q = 0 whatever the scale
    q = np.clip(np.rint(g / safe[:, :, None]), -127, 127).astype(np.int8)
    return Decoded(q=q.reshape(rows, cols), scales=scales.astype(np.float32), offsets=None, group=group)


def dequantize(d: Decoded) -> np.ndarray:
    """The float32 weights (rows, cols): ``scale * q``, then ``+ offset`` (two roundings, as gguf)."""
    rows, cols = d.q.shape
    w = d.q.astype(np.float32).reshape(rows, -1, d.group) * d.scales[:, :, None]
    w = w.reshape(rows, cols)
    if d.offsets is not None:
        w = (w.reshape(rows, -1, d.offset_group) + d.offsets[:, :, None]).reshape(rows, cols)
    return w
