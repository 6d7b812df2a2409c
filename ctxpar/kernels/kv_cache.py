"""A quantized KV cache's write (layout: ctxpar/layers/kv_quant.py): entries as rows
of codes and scales (kv_quantize.cpp). The attention kernels read such rows in
place (attention_kernels.py)."""

from __future__ import annotations

import torch

from ctxpar import kernels
from ctxpar.kernels import attention_kernels as attn_kernels


def kv_quantize(
    x: torch.Tensor, runs: torch.Tensor, codes: torch.dtype, scale_offset: int, row_bytes: int
) -> torch.Tensor:
    """KV entries (n, width) float32 (rows contiguous) -> (n, row_bytes) uint8 quantized rows
    (ctxpar/layers/kv_quant.py's layout): runs (R,) int64 the widths that share a scale."""
    n = x.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(n, row_bytes, dtype=torch.uint8)
    args = (runs.data_ptr(), len(runs), attn_kernels.CODES[codes], scale_offset, row_bytes, out.data_ptr())
    kernels.loaded().kv_quantize(x.data_ptr(), n, x.stride(0), *args)
    return out
