"""A quantized KV cache's kernels (layout: ctxpar/layers/kv_quant.py): writing
entries as rows of codes and scales (kv_quantize.cpp), and prefill attention
over such rows, dequantized block by block (prefill_attention.cpp). The decode
kernel reads them through ``attn_kernels.paged_decode``."""

from __future__ import annotations

import torch

from ctxpar import kernels
from ctxpar.kernels import attention_kernels as attn_kernels


def prefill_quant_usable(q: torch.Tensor, quant: attn_kernels.QuantRows) -> bool:
    """Whether ``prefill_attention_quant`` takes these queries over a GQA cache of this format."""
    _, _, D = quant.entry_shape
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and q.stride(-1) == 1
        and q.stride(-2) == q.shape[-1]
        and kernels.available()
        and bool(kernels.loaded().prefill_attention_supports(D, D))
    )


def prefill_attention_quant(
    q: torch.Tensor,
    rows: torch.Tensor,
    quant: attn_kernels.QuantRows,
    scale: float,
    causal: bool = True,
    out: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefill_attention`` over S quantized rows (S, row_bytes) of a GQA cache
    (K and V of each head with its own scale), dequantized block by block in the
    kernel: q (L, H, D) ``prefill_quant_usable``; causal and counts as there.
    Returns out (L, H, D), written into `out` if given, and lse (L, H), float32."""
    (L, H, D), (S, row_bytes), (_, Hk, _) = q.shape, rows.shape, quant.entry_shape
    rows = rows.contiguous()
    out = attn_kernels.attention_out(out, (L, H, D), "prefill_attention_quant")
    lse = torch.empty(L, H, dtype=torch.float32)
    sizes = (L, S, H, Hk, D, D, q.stride(0), row_bytes, Hk * D, int(causal))
    scales = (attn_kernels.CODES[quant.codes], quant.scale_offset, 1, Hk)  # one scale per K head, then per V head
    pointers = (q.data_ptr(), rows.data_ptr())
    lib = kernels.loaded()
    lib.prefill_attention_quant(
        *pointers, *sizes, attn_kernels.key_counts(counts, L, S), *scales, scale, out.data_ptr(), lse.data_ptr()
    )
    return out, lse


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
