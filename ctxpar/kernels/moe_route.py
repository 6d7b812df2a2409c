"""A mixture of experts' routing and its shared expert's sigmoid gate (moe_route.cpp).

The expert layer (ctxpar/layers/moe.py) calls these where ``usable``; the compiled decode
loop (decode_loop.cpp) calls the same C functions, so both paths choose and weigh a token's
experts with the same bits. Elsewhere (GPUs, ``CTXPAR_KERNELS=0``) the layer keeps
PyTorch's ops.
"""

from __future__ import annotations

import torch

from ctxpar import kernels


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through these kernels: float32 on the CPU, kernels on and built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and kernels.available()


def route(logits: torch.Tensor, top_k: int, renorm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (n, experts) -> (weights (n, top_k) float32, ids (n, top_k) int64): each row's
    top_k experts by softmax score, best first (equal scores: the lower id first), their scores
    renormalised to sum to 1 where ``renorm``, times ``scaling``."""
    n, experts = logits.shape
    if not 0 < top_k <= experts or not usable(logits):
        raise ValueError(f"moe_route: float32 CPU logits (n, experts) and 0 < top_k <= {experts}, got {top_k}")
    logits = logits.contiguous()
    weights = torch.empty(n, top_k, dtype=torch.float32)
    ids = torch.empty(n, top_k, dtype=torch.int64)
    kernels.loaded().moe_route_f32(
        logits.data_ptr(), n, experts, top_k, int(renorm), scaling, weights.data_ptr(), ids.data_ptr()
    )
    return weights, ids


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) elementwise, float32 on the CPU, in x's shape."""
    if not usable(x):
        raise ValueError("moe_route.sigmoid: a float32 CPU tensor")
    x = x.contiguous()
    out = torch.empty_like(x)
    kernels.loaded().sigmoid_f32(x.data_ptr(), x.numel(), out.data_ptr())
    return out
