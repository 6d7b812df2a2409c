"""The decoder layer's elementwise steps in one pass each (elementwise.cpp):
RMSNorm (with the residual add before it fused in; over each head in place), SiLU·up, GELU-tanh·up, rope in place, and
the Walsh-Hadamard turn of a quantized KV cache's heads (ctxpar/layers/kv_rotation.py).

Each takes fp32 or bf16 CPU tensors (``usable``; the Hadamard turn fp32 only);
callers keep PyTorch's ops for the rest (other dtypes, GPUs, ``CTXPAR_KERNELS=0``),
which are also the kernels' reference in the tests. bf16 is computed in floats and
rounded where PyTorch's bf16 ops round (elementwise.cpp).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctxpar import kernels
from ctxpar.kernels import scratch

DTYPES = (torch.float32, torch.bfloat16)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether these tensors go through the kernels: on the CPU, all fp32 or all bf16,
    kernels on and built."""
    dtypes = {t.dtype for t in tensors}
    return (
        all(t.device.type == "cpu" for t in tensors)
        and len(dtypes) == 1
        and dtypes <= set(DTYPES)
        and kernels.available()
    )


def _kernel(name: str, dtype: torch.dtype) -> Callable[..., None]:
    """The kernel ``name`` for tensors of ``dtype`` (its _f32 or _bf16 symbol)."""
    if dtype not in DTYPES:
        raise ValueError(f"{name}: float32 or bfloat16 tensors only, got {dtype}")
    return getattr(kernels.loaded(), f"{name}_{'f32' if dtype == torch.float32 else 'bf16'}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (n, dim), rows contiguous -> x / sqrt(mean(x^2) + eps) * weight (n, dim),
    in x's dtype (weight and residual of it too). With residual (n, dim)
    contiguous: residual += x in place first, and the result is the norm of that sum."""
    n, dim = x.shape
    if (
        x.stride(1) != 1
        or not weight.is_contiguous()
        or weight.numel() != dim
        or (residual is not None and (not residual.is_contiguous() or residual.shape != x.shape))
        or not usable(*(t for t in (x, weight, residual) if t is not None))
    ):
        raise ValueError(
            "rms_norm: x (n, dim) with contiguous rows, weight (dim,), residual (n, dim) contiguous, "
            "all float32 or all bfloat16"
        )
    out = torch.empty(n, dim, dtype=x.dtype)
    residual_ptr = 0 if residual is None else residual.data_ptr()
    kernel = _kernel("rms_norm", x.dtype)
    kernel(x.data_ptr(), x.stride(0), residual_ptr, weight.data_ptr(), n, dim, eps, out.data_ptr())
    return out


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Normalise each head of x (n, heads, dim) in place, as ``rms_norm`` does a row;
    heads contiguous rows (tokens may be strided), weight (dim,) contiguous, of x's dtype."""
    n, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or not weight.is_contiguous() or weight.numel() != dim:
        raise ValueError("rms_norm_heads_: x's heads must be contiguous rows, weight (dim,) contiguous")
    if not usable(x, weight):
        raise ValueError("rms_norm_heads_: x and weight must be both float32 or both bfloat16, on the CPU")
    _kernel("rms_norm_heads", x.dtype)(x.data_ptr(), x.stride(0), n, heads, weight.data_ptr(), dim, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (n, 2I) contiguous, gate then up -> silu(gate) * up (n, I), in its dtype."""
    return _gated_mul("silu_mul", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (n, 2I) contiguous, gate then up -> gelu_tanh(gate) * up (n, I), in its dtype."""
    return _gated_mul("gelu_tanh_mul", gate_up)


def _gated_mul(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    n, two_inter = gate_up.shape
    if not gate_up.is_contiguous():
        raise ValueError(f"{name}: gate_up must be contiguous")
    out = scratch.empty((n, two_inter // 2), gate_up.dtype)
    _kernel(name, gate_up.dtype)(gate_up.data_ptr(), n, two_inter // 2, out.data_ptr())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x (n, heads, dim) in place (half-split pairs), heads contiguous rows
    (tokens may be strided), fp32 or bf16; cos, sin (n, rot/2) contiguous float32: each
    head's first rot dims turn (rot < dim: a partial rotary factor's), the others stay."""
    n, heads, dim = x.shape
    rot = 2 * cos.shape[-1]
    half = (n, rot // 2)
    if x.stride(2) != 1 or x.stride(1) != dim or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_: x's heads must be contiguous rows, cos and sin contiguous")
    if (
        cos.shape != half
        or sin.shape != half
        or not 0 < rot <= dim
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
    ):
        raise ValueError(
            f"rope_: cos and sin must be float32 (n, rot/2) with rot <= {dim}, "
            f"got {cos.dtype} {tuple(cos.shape)}, {sin.dtype} {tuple(sin.shape)} for {n} tokens"
        )
    args = (x.data_ptr(), x.stride(0), n, heads, dim)
    if rot == dim:
        _kernel("rope", x.dtype)(*args, cos.data_ptr(), sin.data_ptr())
    else:
        _kernel("rope_partial", x.dtype)(*args, rot, cos.data_ptr(), sin.data_ptr())


def hadamard_(x: torch.Tensor, scale: float) -> None:
    """Each head of x (n, heads, dim) float32 times the Walsh-Hadamard matrix, then
    ``scale``, in place; heads contiguous rows (tokens may be strided), dim a power of two."""
    n, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or x.dtype != torch.float32:
        raise ValueError("hadamard_: x must be float32, its heads contiguous rows")
    kernels.loaded().hadamard_f32(x.data_ptr(), x.stride(0), n, heads, dim, scale)
