"""Projections against block-quantized weights (quant_gemv.cpp): the weight as
stored (4 or 8 bits a weight, a scale per group of 16 or 32, an optional
offset per 32; scales and offsets float32, or both float16 where the weight's
values are halves: half.h), the activations quantized per block of 32
to int8 inside the kernel; and the weight's rows dequantized to float32, where
no kernel multiplies them (quant_dequant.cpp).

A weight reaches the kernels as ``QuantPart``s (quant_part.h): pointers and
strides, so that a GGUF file's blocks are read where its memory map holds them,
and a fused projection's parts where each lies."""

from __future__ import annotations

import ctypes

import torch

from ctxpar import kernels
from ctxpar.kernels import scratch

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class QuantPart(ctypes.Structure):
    """quant_part.h's QuantPart: one weight's rows, by pointers and strides (in elements)."""

    _fields_ = [
        ("q", _ptr),
        ("scales", _ptr),
        ("offsets", _ptr),
        ("rows", _i64),
        ("q_row", _i64),
        ("q_block", _i64),
        ("s_row", _i64),
        ("s_col", _i64),
        ("o_row", _i64),
        ("o_col", _i64),
    ]


def part(qs: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int) -> QuantPart:
    """The kernels' view of a weight: qs (out, in * bits / 8) or (out, in / 32, 32 * bits / 8)
    uint8, scales (out, in / group), offsets (out, in / 32) or None, each at its own strides
    (a block's bytes, and a row's, contiguous within: layers/quant_linear.py checks that)."""
    q_block = qs.stride(1) if qs.dim() == 3 else 32 * bits // 8
    o_row, o_col = (0, 0) if offsets is None else offsets.stride()
    return QuantPart(
        qs.data_ptr(),
        scales.data_ptr(),
        None if offsets is None else offsets.data_ptr(),
        qs.shape[0],
        qs.stride(0),
        q_block,
        *scales.stride(),
        o_row,
        o_col,
    )


def quant_linear(
    x: torch.Tensor,
    parts: ctypes.Array,
    out_features: int,
    bits: int,
    group: int,
    half: bool,
    zero: int = 0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (n, in) float32, rows contiguous -> x @ W^T (+ bias) (n, out) float32, W
    (out, in) given as ``parts`` (an array of QuantPart, their rows one after another,
    out_features in all), of ``bits`` 4 or 8, scales per ``group`` of 16 or 32, float16
    if ``half`` else float32; in a multiple of 32. zero 8: weight = scale * (q - 8)
    (GGUF's Q4_0, 4 bits, groups of 32, no offsets)."""
    n, in_features = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    # The weight's layout is the caller's (layers/quant_linear.py builds and checks it once,
    # at load); a decode step makes ~120 of these calls, so only what each call brings is
    # checked: x's dtype and width, and the bias's length.
    if x.dtype != torch.float32 or in_features % 32:
        raise ValueError(f"quant_linear: x must be float32, a multiple of 32 features; got {x.dtype} {tuple(x.shape)}")
    if bias is not None and bias.numel() != out_features:
        raise ValueError(f"quant_linear: bias has {bias.numel()} values for {out_features} outputs")
    out = scratch.empty((n, out_features))
    kernels.loaded().quant_linear_f32(
        x.data_ptr(),
        x.stride(0),
        n,
        in_features,
        ctypes.addressof(parts),
        len(parts),
        bits,
        group,
        half,
        zero,
        0 if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(),
    )
    return out


def quant_dequantize(
    weight: QuantPart, in_features: int, bits: int, group: int, half: bool, rows: range | torch.Tensor, zero: int = 0
) -> torch.Tensor:
    """The weight's rows ``rows`` (as ``quant_linear`` takes a part): a range of them, or
    an int64 tensor (n,) of row ids (an embedding's lookup), as float32 (n, in):
    ``scale * (q - zero)``, then ``+ offset``."""
    ids = None
    if isinstance(rows, range):
        if rows.step != 1 or not 0 <= rows.start <= rows.stop <= weight.rows:
            raise ValueError(f"quant_dequantize: rows {rows} are not a run inside the weight's {weight.rows} rows")
        first, count = rows.start, len(rows)
    else:
        ids = rows.to(torch.int64).contiguous()
        if ids.dim() != 1 or (len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < weight.rows):
            raise ValueError(f"quant_dequantize: row ids must be (n,) within the weight's {weight.rows} rows")
        first, count = 0, len(ids)
    out = torch.empty(count, in_features, dtype=torch.float32)
    kernels.loaded().quant_dequantize_f32(
        ctypes.addressof(weight),
        half,
        bits,
        group,
        zero,
        0 if ids is None else ids.data_ptr(),
        first,
        count,
        in_features,
        out.data_ptr(),
    )
    return out


def int8_peak_ops(rounds: int) -> int:
    """The integer operations (a multiply and an add each) of ``rounds`` rounds of 12
    independent int8 dot products of the kernels' widest kind on every thread, in
    registers and nothing else (quant_gemv.cpp's quant_peak_ops): the peak that a
    projection's rate is measured against. 0 on a CPU without AVX2."""
    return int(kernels.loaded().quant_peak_ops(rounds))
