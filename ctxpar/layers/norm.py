"""RMSNorm, computed in fp32 like the Hugging Face reference implementations."""

from __future__ import annotations

import torch
from torch import nn

from ctxpar.kernels import elementwise


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dimension.

    The weight is created empty in the default dtype (the loader fills it).
    Low-precision inputs are normalised in fp32 and cast back before the
    weight is applied, exactly as transformers' LlamaRMSNorm does.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with `residual` (the stream x is added to): residual += x in
        place, then norm(residual), in one pass where the kernel serves."""
        tensors = (x, self.weight) if residual is None else (x, self.weight, residual)
        if x.dim() == 2 and x.stride(-1) == 1 and all(t.is_contiguous() for t in tensors[1:]):
            if elementwise.usable(*tensors):
                return elementwise.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def norm_heads_(norm: RMSNorm, x: torch.Tensor) -> None:
    """Normalise each head of x (n, heads, dim) in place with ``norm`` (Qwen3's and Gemma 3's
    norms of the Q and K heads inside the QKV projection's rows); in one pass where the kernel
    serves, the pass the compiled decode loop makes too (ctxpar/models/compiled_decode.py)."""
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] and elementwise.usable(x, norm.weight):
        elementwise.rms_norm_heads_(x, norm.weight, norm.eps)
    else:
        x.copy_(norm(x))


def unit_offset(w: torch.Tensor) -> torch.Tensor:
    """A Gemma norm's checkpoint weight w as the factor RMSNorm multiplies by: 1 + w, computed
    in float32 as transformers' Gemma2RMSNorm/Gemma3RMSNorm compute it on every call, so that an
    fp32 model's norm multiplies by the very factor transformers' does."""
    return 1.0 + w.float()
