"""A quantized KV cache: each token's entry stored as 1-byte codes and float32 scales.

``kv_cache_dtype`` (vLLM's spellings, plus llama.cpp's q8_0 idea as "int8"; the
engine's default on the CPU for a float32 model with quantized weights, ctxpar/config.py):

- "int8": codes round(x / s) in [-127, 127], s = max|x| / 127;
- "fp8" = "fp8_e4m3", "fp8_e5m2": codes (x / s) rounded to float8, s = max|x| / the
  format's largest finite value. vLLM keeps fp8 unscaled (or one scale per layer,
  calibrated); a scale per run costs 4 bytes in 128-256 and keeps a layer whose K
  has large outliers from flushing the small values of other tokens to zero.

One scale per *run* of an entry: GQA's entry (2, Hk, D) has 2·Hk runs of D values
(K of each KV head, then V of each: one scale per token per head); MLA's entry
(r + rope,) has two, the latent c_kv and the roped key k_pe, whose ranges differ
(k_pe is not normalised), so each gets its own scale.

The cache of a layer is then (num_slots, row_bytes) uint8, one row per token:

    [ codes: the entry's values in order, 1 byte each, padded to 4 bytes | scales: float32 per run ]

Rows are opaque bytes to everything that moves them (the cache writes, PCP's
all-gather, prefix-cache reuse, a led step's broadcast), so those send the
quantized bytes, never floats. The compiled attention kernels read
rows in place and dequantize a run of keys at a time (ctxpar/kernels); other
paths call ``dequantize`` on the rows they attend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from ctxpar import kernels
from ctxpar.kernels import kv_cache as kv_kernels

CODE_DTYPES = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# Largest code magnitude: int8 keeps -128 unused so the range is symmetric.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dataclass(frozen=True)
class KVQuant:
    """How one model's KV-cache entries are quantized.

    codes: the 1-byte code dtype; entry_shape: one token's float entry in one
    layer (the model's kv_entry_shape); runs: widths of the consecutive runs of
    the flattened entry that share one scale (sum = the entry's size).
    """

    codes: torch.dtype
    entry_shape: tuple[int, ...]
    runs: tuple[int, ...]

    @classmethod
    def of(cls, kv_cache_dtype: str, entry_shape: tuple[int, ...], runs: tuple[int, ...]) -> KVQuant | None:
        """The format of ``kv_cache_dtype`` (validated and resolved by EngineConfig); None for
        "model" (the model's dtype)."""
        if kv_cache_dtype == "model":
            return None
        assert sum(runs) == math.prod(entry_shape), (runs, entry_shape)
        return cls(CODE_DTYPES[kv_cache_dtype], tuple(entry_shape), tuple(runs))

    @property
    def width(self) -> int:
        """Values per entry."""
        return sum(self.runs)

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scales in a row: the codes, padded so the floats are aligned."""
        return -(-self.width // 4) * 4

    @property
    def row_bytes(self) -> int:
        return self.scale_offset + 4 * len(self.runs)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """(n, width) -> per distinct run width, (n, runs of that width, width) views or copies, in order."""
        if len(set(self.runs)) == 1:  # GQA: every run one head, a view
            return [flat.view(flat.shape[0], len(self.runs), self.runs[0])]
        return [part.unsqueeze(1) for part in flat.split(list(self.runs), dim=1)]

    @cached_property
    def _runs(self) -> torch.Tensor:
        return torch.tensor(self.runs, dtype=torch.int64)

    def quantize(self, entries: torch.Tensor) -> torch.Tensor:
        """(n, *entry_shape) float -> (n, row_bytes) uint8 rows: on the CPU in one pass
        of the compiled kernel, elsewhere with PyTorch's ops (``quantize_torch``),
        which round alike (to nearest, ties to even)."""
        flat = entries.reshape(entries.shape[0], self.width).float()
        if flat.device.type == "cpu" and kernels.available():
            return kv_kernels.kv_quantize(flat, self._runs, self.codes, self.scale_offset, self.row_bytes)
        return self.quantize_torch(flat)

    def quantize_torch(self, flat: torch.Tensor) -> torch.Tensor:
        """(n, width) float32 -> (n, row_bytes) uint8 rows, with PyTorch's ops."""
        n = flat.shape[0]
        parts = self._split(flat)
        qmax = QMAX[self.codes]
        scales = torch.cat([p.abs().amax(-1) for p in parts], dim=1) / qmax  # (n, runs)
        inv = torch.where(scales > 0, 1.0 / scales, 0.0)  # an all-zero run: codes 0, scale 0
        codes = torch.cat([(p * inv_p.unsqueeze(-1)).flatten(1) for p, inv_p in zip(parts, self._per_part(inv))], 1)
        codes = codes.clamp_(-qmax, qmax)  # a rounding past qmax would be NaN in fp8
        if self.codes == torch.int8:
            codes = codes.round_()
        rows = torch.zeros(n, self.row_bytes, dtype=torch.uint8, device=flat.device)
        rows[:, : self.width] = codes.to(self.codes).view(torch.uint8)
        rows[:, self.scale_offset :] = scales.contiguous().view(torch.uint8)
        return rows

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """(m, row_bytes) uint8 rows -> (m, *entry_shape) float32 entries."""
        m = rows.shape[0]
        codes = rows[:, : self.width].contiguous().view(self.codes).float()
        scales = rows[:, self.scale_offset :].contiguous().view(torch.float32)  # (m, runs)
        parts = self._split(codes)
        out = [(p * s.unsqueeze(-1)).flatten(1) for p, s in zip(parts, self._per_part(scales))]
        return torch.cat(out, dim=1).view(m, *self.entry_shape)

    def _per_part(self, per_run: torch.Tensor) -> list[torch.Tensor]:
        """(n, runs) -> the columns of each part of ``_split``, (n, runs in the part)."""
        if len(set(self.runs)) == 1:
            return [per_run]
        return list(per_run.split(1, dim=1))


def default_runs(entry_shape: tuple[int, ...]) -> tuple[int, ...]:
    """One scale per innermost row of the entry: GQA's (2, Hk, D) -> 2·Hk runs of D."""
    return (entry_shape[-1],) * math.prod(entry_shape[:-1])


def kv_bytes_per_token_per_layer(
    entry_shape: tuple[int, ...], runs: tuple[int, ...], dtype: torch.dtype, kv_cache_dtype: str
) -> int:
    """Bytes one token's entry takes in one layer's cache: the model's dtype for "model", else a quantized row."""
    quant = KVQuant.of(kv_cache_dtype, entry_shape, runs)
    if quant is None:
        return math.prod(entry_shape) * torch.empty((), dtype=dtype).element_size()
    return quant.row_bytes
