"""The decoder layer's elementwise steps in one pass each (elementwise.cpp):
RMSNorm (with the residual add before it fused in), SiLU·up, rope in place, and
the Walsh-Hadamard turn of a quantized KV cache's heads (ctxpar/layers/kv_rotation.py).

Each takes fp32 CPU tensors (``usable``); callers keep PyTorch's ops for the
rest (other dtypes, GPUs, ``CTXPAR_KERNELS=0``), which are also the kernels'
reference in the tests.
"""

from __future__ import annotations

import torch

from ctxpar import kernels


def usable(*tensors: torch.Tensor) -> bool:
    """Whether these tensors go through the kernels: fp32 on the CPU, kernels on and built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and kernels.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (n, dim), rows contiguous -> x / sqrt(mean(x^2) + eps) * weight (n, dim).
    With residual (n, dim) contiguous: residual += x in place first, and the
    result is the norm of that sum."""
    n, dim = x.shape
    if (
        x.stride(1) != 1
        or not weight.is_contiguous()
        or weight.numel() != dim
        or (residual is not None and (not residual.is_contiguous() or residual.shape != x.shape))
    ):
        raise ValueError("rms_norm: x (n, dim) with contiguous rows, weight (dim,), residual (n, dim) contiguous")
    out = torch.empty(n, dim, dtype=torch.float32)
    residual_ptr = 0 if residual is None else residual.data_ptr()
    kernels.loaded().rms_norm_f32(
        x.data_ptr(), x.stride(0), residual_ptr, weight.data_ptr(), n, dim, eps, out.data_ptr()
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (n, 2I) contiguous, gate then up -> silu(gate) * up (n, I)."""
    n, two_inter = gate_up.shape
    if not gate_up.is_contiguous():
        raise ValueError("silu_mul: gate_up must be contiguous")
    out = torch.empty(n, two_inter // 2, dtype=torch.float32)
    kernels.loaded().silu_mul_f32(gate_up.data_ptr(), n, two_inter // 2, out.data_ptr())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x (n, heads, dim) in place (half-split pairs), heads contiguous rows
    (tokens may be strided); cos, sin (n, dim/2) contiguous."""
    n, heads, dim = x.shape
    half = (n, dim // 2)
    if x.stride(2) != 1 or x.stride(1) != dim or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_: x's heads must be contiguous rows, cos and sin contiguous")
    if cos.shape != half or sin.shape != half:
        raise ValueError(f"rope_: cos and sin must be {half}, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    kernels.loaded().rope_f32(x.data_ptr(), x.stride(0), n, heads, dim, cos.data_ptr(), sin.data_ptr())


def hadamard_(x: torch.Tensor, scale: float) -> None:
    """Each head of x (n, heads, dim) times the Walsh-Hadamard matrix, then ``scale``,
    in place; heads contiguous rows (tokens may be strided), dim a power of two."""
    n, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim:
        raise ValueError("hadamard_: x's heads must be contiguous rows")
    kernels.loaded().hadamard_f32(x.data_ptr(), x.stride(0), n, heads, dim, scale)
