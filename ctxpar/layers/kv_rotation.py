"""A quantized KV cache stores each head's keys and values turned by a Walsh-Hadamard
rotation, as QuaRot does for quantized activations.

A few channels of a head's keys are much larger than the rest, and queries are large
in the same channels, so the rounding of those channels dominates the error of every
logit: fp8's relative precision is fixed by its mantissa, so no scale can help. An
orthogonal rotation spreads each channel over all of them. Turning the queries, keys
and values of a head by the same orthogonal H leaves attention as it was, in exact
arithmetic:

    (H q) . (H k) = q . k              softmax weights p unchanged
    sum_i p_i (H v_i) = H sum_i p_i v_i   so the output is turned back by H^T

H = F / sqrt(d) with F Sylvester's Walsh-Hadamard matrix (entries +-1, F F = d I),
applied as log2(d) stages of sums and differences. The 1/d that two applications of
F leave is split into two powers of two, ``scales(d)``: the queries and the output
take one, the keys and values the other, so every scaling is exact, and the kernel
(elementwise.cpp) and the PyTorch path below compute the same bits for a head, however
many tokens a call holds (ranks, steps and the compiled decode loop agree).

Measured (docs/benchmarks.md, "Quantized KV caches with turned heads"): on 2048 tokens of
English, fp8_e4m3's perplexity is about 0.5% above the unquantized cache's with the turn
and about 1% above it without.
"""

from __future__ import annotations

import torch

from ctxpar.kernels import elementwise


def turns(head_dim: int) -> bool:
    """Whether heads of this size are turned: Sylvester's matrices have sizes 2^k."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def scales(head_dim: int) -> tuple[float, float]:
    """(query_scale, kv_scale): powers of two whose product with head_dim is 1. The
    queries and the attention output take the first, keys and values the second."""
    log = head_dim.bit_length() - 1
    return 2.0 ** -(log - log // 2), 2.0 ** -(log // 2)


def turn(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (n, ..., dim), each head's run times F, then ``scale``: turned in place and returned
    where the kernel takes x as it lies (float32, each token's heads contiguous runs, tokens
    at one stride: the views of a projection's output that attention is given), else a new
    tensor. Either way the same bits."""
    runs = _runs(x)  # (n, heads, dim) of x's own memory, or None
    if runs is not None and elementwise.usable(runs):
        elementwise.hadamard_(runs, scale)
        return x
    shape, dim = x.shape, x.shape[-1]
    out = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True).view(-1, 1, dim)
    if elementwise.usable(out):
        elementwise.hadamard_(out, scale)
    else:
        out = _turn_torch(out.view(-1, dim), scale)
    return out.view(shape).to(x.dtype)


def _runs(x: torch.Tensor) -> torch.Tensor | None:
    """x (n, ..., dim) as (n, heads, dim) without a copy, if float32 with each token's heads
    one contiguous run after another; else None."""
    if x.dtype != torch.float32 or x.dim() < 2 or x.stride(-1) != 1:
        return None
    try:
        runs = x.view(x.shape[0], -1, x.shape[-1])
    except RuntimeError:  # its heads are not evenly strided
        return None
    return runs if runs.stride(1) == runs.shape[2] else None


def _turn_torch(x: torch.Tensor, scale: float) -> torch.Tensor:
    """(rows, dim) float32: hadamard_f32's stages with PyTorch's ops, in its order."""
    rows, dim = x.shape
    h = 1
    while h < dim:
        pairs = x.view(rows, dim // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).view(rows, dim)
        h *= 2
    return x * scale
