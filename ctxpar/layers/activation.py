"""The gated MLPs' activations: SwiGLU's silu(gate) * up, Gemma's gelu_tanh(gate) * up."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ctxpar.kernels import elementwise


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (n, 2I), gate then up -> silu(gate) * up (n, I): one pass in the
    kernel; PyTorch's ops elsewhere (in place on the gate half of gate_up)."""
    if elementwise.usable(gate_up) and gate_up.is_contiguous():
        return elementwise.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)  # (n, I), strided view of gate_up


_GELU_BETA = math.sqrt(2) * 2 / math.sqrt(math.pi) * 0.5  # sqrt(2 / pi), as PyTorch's kernel spells it
_GELU_KAPPA = 0.044715


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (n, 2I), gate then up -> gelu_tanh(gate) * up (n, I) in gate_up's dtype, the gelu
    computed in float32 and rounded once, as ``F.gelu(approximate="tanh")`` (transformers'
    gelu_pytorch_tanh) does. One pass in the kernel (the compiled decode loop's too); elsewhere
    spelled out in elementwise ops (PyTorch's formula): ``F.gelu``'s vectorized loop and its
    scalar tail round tanh differently, so an element's bits would depend on where the call's
    end falls; torch.tanh's do not."""
    if elementwise.usable(gate_up) and gate_up.is_contiguous():
        return elementwise.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    x = gate.float()
    inner = (x + _GELU_KAPPA * (x * x * x)) * _GELU_BETA
    act = (x * 0.5) * (torch.tanh(inner) + 1.0)
    return act.to(gate_up.dtype).mul_(up)  # (n, I)
