"""SwiGLU's activation: silu(gate) * up."""

from __future__ import annotations

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
