"""Projections against block-quantized weights (quant_gemv.cpp): the weight as
stored (4 or 8 bits a weight, a scale per group of 16 or 32, an optional
offset per 32; scales and offsets float32, or both float16 where the weight's
values are halves: half.h), the activations quantized per block of 32
to int8 inside the kernel; and the weight's rows dequantized to float32, where
no kernel multiplies them (quant_dequant.cpp)."""

from __future__ import annotations

import torch

from ctxpar import kernels


def quant_linear(
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
    zero: int = 0,
) -> torch.Tensor:
    """x (n, in) float32, rows contiguous -> x @ W^T (+ bias) (n, out) float32, W
    (out, in) given as qs (out, in * bits / 8) uint8, scales (out, in / group),
    offsets (out, in / 32) or None (of the scales' dtype, float32 or float16), all
    contiguous; in a multiple of 32. zero 8: weight = scale * (q - 8) (GGUF's Q4_0,
    4 bits, groups of 32, no offsets)."""
    n, in_features = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    # The weight's layout is the caller's (layers/quant_linear.py builds and checks it once,
    # at load); a decode step makes ~120 of these calls, so only what each call brings is
    # checked: x against the weight's width, and the bias's length.
    rows, width = qs.shape
    if x.dtype != torch.float32 or in_features % 32 or width * 8 != in_features * bits:
        raise ValueError(
            f"quant_linear: x must be float32 with the weight's {width * 8 // bits} features (a multiple of 32), "
            f"got {x.dtype} {tuple(x.shape)}"
        )
    if bias is not None and bias.numel() != rows:
        raise ValueError(f"quant_linear: bias has {bias.numel()} values for {rows} outputs")
    out = torch.empty(n, rows, dtype=torch.float32)
    kernels.loaded().quant_linear_f32(
        x.data_ptr(),
        x.stride(0),
        n,
        in_features,
        rows,
        bits,
        qs.data_ptr(),
        scales.data_ptr(),
        group,
        0 if offsets is None else offsets.data_ptr(),
        scales.dtype == torch.float16,
        zero,
        0 if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(),
    )
    return out


def quant_dequantize(
    qs: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group: int,
    first: int = 0,
    rows: int | None = None,
    zero: int = 0,
) -> torch.Tensor:
    """Rows [first, first + rows) of the weight (as ``quant_linear`` takes it) as
    float32 (rows, in): ``scale * (q - zero)``, then ``+ offset``."""
    rows = qs.shape[0] - first if rows is None else rows
    _check_rows(qs, first, rows)
    in_features = qs.shape[1] * 8 // bits
    out = torch.empty(rows, in_features, dtype=torch.float32)
    kernels.loaded().quant_dequantize_f32(
        qs.data_ptr(),
        scales.data_ptr(),
        0 if offsets is None else offsets.data_ptr(),
        scales.dtype == torch.float16,
        bits,
        group,
        zero,
        first,
        rows,
        in_features,
        out.data_ptr(),
    )
    return out


def _check_rows(qs: torch.Tensor, first: int, rows: int) -> None:
    """Rows [first, first + rows) lie in the weight: the kernels read them unchecked."""
    if first < 0 or rows < 0 or first + rows > qs.shape[0]:
        raise ValueError(f"quant_dequantize: rows [{first}, {first + rows}) outside the weight's {qs.shape[0]} rows")
