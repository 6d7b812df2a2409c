"""fp32 and bf16 projections against packed weights (gemv.cpp's panels; on CPUs
with AMX-BF16, bf16 on its tiles, bf16_tiles.h)."""

from __future__ import annotations

import torch

from ctxpar import kernels
from ctxpar.kernels import scratch


def panel_width() -> int:
    """Output rows per panel of the packed weight layout (kernels/gemv.cpp)."""
    return kernels.loaded().linear_panel_width()


def bf16_tiles() -> bool:
    """Whether bf16 projections run on AMX's tiles (kernels/bf16_tiles.h: a CPU with
    AMX-BF16 that the kernel may use), else on the panel loop (kernels/gemv.cpp)."""
    return bool(kernels.loaded().linear_bf16_tiles())


def linear_packed(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x (n, in) @ W^T (+ bias) -> (n, out_features) out_dtype, rows of x contiguous
    (tokens may be strided). W packed float32 (ceil(out / panel_width), in,
    panel_width) with x float32, or bfloat16 (ceil(out / panel_width), ceil(in / 2),
    panel_width, 2) with x bfloat16 (gemv.cpp's layouts). With a bfloat16 packing,
    out_dtype bfloat16 has the kernel write bf16, the bits ``.to(torch.bfloat16)`` of
    the float32 result gives, at half the bytes."""
    n, in_features = x.shape
    # The kernel reads ceil(out / panel_width) panels of the packing's width, and out_features biases.
    if (
        packed.dim() < 3
        or packed.shape[2] != panel_width()
        or packed.shape[0] * packed.shape[2] < out_features
        or not packed.is_contiguous()
    ):
        raise ValueError(
            f"linear_packed: the packed weight {tuple(packed.shape)} (contiguous: {packed.is_contiguous()}) "
            f"does not hold {out_features} output rows"
        )
    if bias is not None and bias.numel() != out_features:
        raise ValueError(f"linear_packed: bias has {bias.numel()} values for {out_features} outputs")
    bf16_out = packed.dtype == torch.bfloat16 and out_dtype == torch.bfloat16
    if out_dtype not in (torch.float32, torch.bfloat16) or (out_dtype == torch.bfloat16 and not bf16_out):
        raise ValueError(f"linear_packed: out_dtype {out_dtype} with a {packed.dtype} packing")
    out = scratch.empty((n, out_features), torch.bfloat16 if bf16_out else torch.float32)
    bias_ptr = 0 if bias is None else bias.float().contiguous().data_ptr()
    if packed.dtype == torch.bfloat16:
        if packed.shape[1] != -(-in_features // 2) or x.dtype != torch.bfloat16:
            raise ValueError(
                f"linear_packed: a bfloat16 packing {tuple(packed.shape)} takes bfloat16 x of "
                f"{2 * packed.shape[1] - 1} or {2 * packed.shape[1]} features, got {x.dtype} {tuple(x.shape)}"
            )
        if in_features % 2 or x.stride(0) % 2 or x.stride(1) != 1 or x.data_ptr() % 4:  # read in aligned pairs
            x = torch.nn.functional.pad(x, (0, in_features % 2))
        kernel = kernels.loaded().linear_packed_bf16_out if bf16_out else kernels.loaded().linear_packed_bf16
        kernel(x.data_ptr(), x.stride(0), n, packed.data_ptr(), packed.shape[1], out_features, bias_ptr, out.data_ptr())
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if packed.shape[1] != in_features or x.dtype != torch.float32 or packed.dtype != torch.float32:
        raise ValueError(
            f"linear_packed: a {packed.dtype} packing {tuple(packed.shape)} takes float32 x of "
            f"{packed.shape[1]} features, got {x.dtype} {tuple(x.shape)}"
        )
    kernels.loaded().linear_packed_f32(
        x.data_ptr(), x.stride(0), n, packed.data_ptr(), in_features, out_features, bias_ptr, out.data_ptr()
    )
    return out
