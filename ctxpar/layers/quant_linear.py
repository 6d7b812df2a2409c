"""Weights kept block-quantized (GGUF's Q4_0 ... Q6_K), and their projections.

A ``QuantWeight`` is the kernel's layout (kernels/quant_gemv.cpp) of a
``Decoded`` tensor (layers/quant_blocks.py): per output row, blocks of 32
weights as 4-bit nibbles (Q4_0, Q4_1, Q4_K: q in 0..15, a scale per 32) or
int8 (Q8_0, Q5_*, Q6_K), a scale per group of 16 or 32 and an optional
offset per 32. The repacking is done once, at load. Scales and offsets stay
float16 where every one of the weight's is a half (the legacy formats' own
fp16 fields: Q4_1 reads its 5 bits a weight, 20 bytes a block), and become
float32 where not (the K-quants' products of two scales, int8 weights
quantized at load), which holds them exactly; the 5- and 6-bit formats widen
to 8 bits.

``linear`` runs a decode step's few rows through the integer kernel, and
more rows (prefill) as float32 products over tiles of rows dequantized on
the fly (dequantized straight into gemv.cpp's panel layout): at many rows reusing each
dequantized weight wins over integer dot products (docs/benchmarks.md, "Quantized weights").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from ctxpar import kernels
from ctxpar.kernels import quant
from ctxpar.layers.quant_blocks import Decoded

# Rows at or above which a projection dequantizes tiles and multiplies in float32:
# the crossover measured on SmolLM2's shapes, AVX2, one core (~100 rows; at 64 the
# integer kernel is 1.2x faster, at 256 the tiles 1.3x: docs/benchmarks.md).
GEMM_MIN_ROWS = 96
# The rows a path is picked by, where the caller sets it (``path_rows``); else each call's own.
_PATH_ROWS: ContextVar[int | None] = ContextVar("ctxpar_quant_path_rows", default=None)
TILE_ROWS = 512  # weight rows per dequantized tile: 512 x 1536 floats = 3 MiB, within L2/L3


@dataclass
class QuantWeight:
    """An (out_features, in_features) weight: row o, weight i = scales[o, i // group] *
    q[o, i] + offsets[o, i // 32] (0 without offsets)."""

    qs: torch.Tensor  # (out, in * bits / 8) uint8: nibbles (bits 4) or int8 bytes (bits 8)
    scales: torch.Tensor  # (out, in / group) float32, or float16 (see the module's docstring)
    offsets: torch.Tensor | None  # (out, in / 32), the scales' dtype
    bits: int  # 4 or 8
    group: int  # 16 or 32

    def __post_init__(self) -> None:
        # The kernel reads these through raw pointers: their layout is checked here, once.
        rows, cols = self.qs.shape[0], self.qs.shape[1] * 8 // self.bits
        assert self.bits in (4, 8) and self.group in (16, 32) and cols % 32 == 0, (self.bits, self.group, cols)
        assert self.qs.dtype == torch.uint8 and self.scales.dtype in (torch.float32, torch.float16)
        assert self.scales.shape == (rows, cols // self.group)
        off = self.offsets
        assert off is None or (off.dtype == self.scales.dtype and off.shape == (rows, cols // 32))
        assert all(t.is_contiguous() for t in self.tensors())

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * 8 // self.bits

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        """Bytes a projection reads: what a decode step's floor counts."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.scales, self.offsets) if t is not None]

    @classmethod
    def from_decoded(cls, d: Decoded, bits: int | None = None) -> QuantWeight:
        """The kernel's layout of ``d``: 4 bits where every q is a nibble and groups are
        32 (or ``bits`` to force 8, e.g. to join a weight whose rows are 8-bit)."""
        rows, cols = d.q.shape
        if bits is None:
            bits = 4 if d.group == 32 and d.q.min(initial=0) >= 0 and d.q.max(initial=0) <= 15 else 8
        if bits == 4:
            q = d.q.astype(np.uint8).reshape(rows, cols // 32, 2, 16)  # weights i and i + 16 share byte i
            qs = (q[:, :, 0] | (q[:, :, 1] << np.uint8(4))).reshape(rows, cols // 2)
        else:
            qs = d.q.view(np.uint8)
        # Scales and offsets as halves where every one is a half (no rounding), else float32.
        fields = [f for f in (d.scales, d.offsets) if f is not None]
        halves = all(np.array_equal(f.astype(np.float16).astype(np.float32), f) for f in fields)
        as_tensor = lambda f: torch.from_numpy(np.ascontiguousarray(f.astype(np.float16 if halves else np.float32)))
        offsets = None if d.offsets is None else as_tensor(d.offsets)
        return cls(torch.from_numpy(np.ascontiguousarray(qs)), as_tensor(d.scales), offsets, bits, d.group)

    def decoded(self) -> Decoded:
        """Back to ``Decoded`` (the inverse of ``from_decoded``)."""
        qs = self.qs.numpy()
        if self.bits == 4:
            rows = qs.shape[0]
            nib = np.stack([qs.reshape(rows, -1, 16) & 15, qs.reshape(rows, -1, 16) >> 4], axis=2)
            q = nib.reshape(rows, -1).astype(np.int8)
        else:
            q = qs.view(np.int8)
        offsets = None if self.offsets is None else self.offsets.float().numpy()
        return Decoded(q, self.scales.float().numpy(), offsets, self.group)

    def rows(self, first: int, end: int) -> QuantWeight:
        """Output rows [first, end) as views (a vocabulary range of the lm_head)."""
        off = None if self.offsets is None else self.offsets[first:end]
        return replace(self, qs=self.qs[first:end], scales=self.scales[first:end], offsets=off)

    def dequantize(self, first: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [first, end) as float32 (end - first, in)."""
        end = self.out_features if end is None else end
        if kernels.available():
            return quant.quant_dequantize(self.qs, self.scales, self.offsets, self.bits, self.group, first, end - first)
        d = self.rows(first, end).decoded()
        w = torch.from_numpy(d.q).float().view(end - first, -1, d.group) * torch.from_numpy(d.scales)[:, :, None]
        w = w.view(end - first, -1)
        if d.offsets is not None:
            w = (w.view(end - first, -1, 32) + torch.from_numpy(d.offsets)[:, :, None]).view(end - first, -1)
        return w


def concat(parts: list[QuantWeight]) -> QuantWeight:
    """The weights' rows one after another (a fused QKV or gate|up projection).
    Parts of different layouts meet in the widest: 8 bits, the finer group; each
    weight's value is unchanged (a nibble is an int8, a scale repeats)."""
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    widened = [_widen(p, bits, group) for p in parts]
    # Halves only if every part's are (a half is exact as a float32, not the reverse).
    dtype = torch.float16 if all(p.scales.dtype == torch.float16 for p in widened) else torch.float32

    def offsets(p: QuantWeight) -> torch.Tensor:
        zeros = torch.zeros(p.out_features, p.in_features // 32, dtype=dtype)
        return zeros if p.offsets is None else p.offsets.to(dtype)

    joined = torch.cat([offsets(p) for p in widened]) if any(p.offsets is not None for p in widened) else None
    return QuantWeight(
        torch.cat([p.qs for p in widened]), torch.cat([p.scales.to(dtype) for p in widened]), joined, bits, group
    )


def _widen(p: QuantWeight, bits: int, group: int) -> QuantWeight:
    if p.bits == bits and p.group == group:
        return p
    d = p.decoded()
    scales = np.repeat(d.scales, d.group // group, axis=1)
    return QuantWeight.from_decoded(Decoded(d.q, scales, d.offsets, group), bits)


@contextmanager
def path_rows(rows: int | None) -> Iterator[None]:
    """Within it, projections pick their path (integer kernel or dequantized tiles) by
    `rows` instead of their own row count: a model's forward passes the step's global
    token count, so a PCP rank computes each token the way one rank alone does (the two
    paths round differently: int8 activations or float32). Both paths compute each
    output row alone, so the same path gives the same row whatever the others."""
    token = _PATH_ROWS.set(rows)
    try:
        yield
    finally:
        _PATH_ROWS.reset(token)


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (n, in) @ w^T (+ bias) -> (n, out) in x's dtype; the path by ``path_rows`` if set."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.float()
    n = x.shape[0]
    rows = _PATH_ROWS.get()
    if (n if rows is None else rows) < GEMM_MIN_ROWS and x.device.type == "cpu" and kernels.available():
        out = quant.quant_linear(x, w.qs, w.scales, w.offsets, w.bits, w.group, bias)
    else:
        out = torch.empty(n, w.out_features, dtype=torch.float32)
        for first in range(0, w.out_features, TILE_ROWS):
            end = min(w.out_features, first + TILE_ROWS)
            tile_bias = None if bias is None else bias[first:end].float()
            out[:, first:end] = _tile_product(x, w, first, end, tile_bias)
    return out if dtype == torch.float32 else out.to(dtype)


def _tile_product(x: torch.Tensor, w: QuantWeight, first: int, end: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x (n, in) @ w's rows [first, end)^T (+ bias): dequantized into the fp32 panel
    kernel's layout (gemv.cpp) where it runs, whose every output row is summed in
    one order whatever the other rows (so P ranks' row subsets compute as one rank
    does); else dequantized for F.linear."""
    if not (kernels.available() and x.device.type == "cpu"):
        return F.linear(x, w.dequantize(first, end), bias)
    panels = quant.quant_dequantize_panels(w.qs, w.scales, w.offsets, w.bits, w.group, first, end - first)
    return kernels.linear_packed(x, panels, end - first, bias)


def quant_embedding(ids: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The rows ``ids`` (n,) of w, dequantized: (n, in) float32 (a quantized embedding table)."""
    sub = QuantWeight(w.qs[ids], w.scales[ids], None if w.offsets is None else w.offsets[ids], w.bits, w.group)
    return sub.dequantize()
