"""The straightforward attention that the attention ops and the compiled kernels are
checked against: explicit scores, an explicit bottom-right causal mask and a
softmax, in float64."""

from __future__ import annotations

import torch

TOL = dict(atol=1e-5, rtol=1e-5)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (L, H, D) the last L positions of k, v (S, Hk, D*) -> out (L, H, Dv), lse (L, H), in float64."""
    L, H, _ = q.shape
    S, Hk, _ = k.shape
    kk = k.double().repeat_interleave(H // Hk, dim=1)
    vv = v.double().repeat_interleave(H // Hk, dim=1)
    s = torch.einsum("lhd,shd->hls", q.double(), kk) * scale  # (H, L, S)
    future = torch.arange(S)[None, :] > (S - L + torch.arange(L))[:, None]
    s = s.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(s, -1)  # (H, L)
    out = torch.einsum("hls,shd->lhd", torch.softmax(s, -1), vv)
    return out, lse.transpose(0, 1)


def paged(lengths: list[int], block_size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows' slots in blocks handed out in a random order, back to back, their
    starts, and the number of slots the cache needs."""
    num_blocks = sum(-(-s // block_size) for s in lengths) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    slots = []
    for s in lengths:
        blocks = torch.tensor([free.pop() for _ in range(-(-s // block_size))], dtype=torch.int64)
        pos = torch.arange(s)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    starts = torch.cumsum(torch.tensor([0] + lengths), 0)
    return torch.cat(slots).long(), starts, num_blocks * block_size


def dequantize64(rows: torch.Tensor, codes: torch.dtype, runs: tuple[int, ...]) -> torch.Tensor:
    """Quantized KV rows (m, row_bytes) (ctxpar/layers/kv_quant.py's layout, read here
    from the bytes on their own) -> (m, sum(runs)) float64 values: code times its run's scale."""
    width = sum(runs)
    offset = -(-width // 4) * 4
    values = rows[:, :width].contiguous().view(codes).double()
    scales = rows[:, offset : offset + 4 * len(runs)].contiguous().view(torch.float32).double()
    return values * scales.repeat_interleave(torch.tensor(runs), dim=1)


def int8_query_bounds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """How far the prefill kernel over int8 rows may be from exact attention over the rows'
    values, beyond float32 rounding: it rounds each query row to int16 codes, a step of
    max|q| / 32767 (kernels/prefill_attention.cpp), so an element of q moves by at most half
    a step, 2^-16 of the row's max|q| (1% more for the float quotient rounded before the
    integer: 32767 · 2^-24 of a step), and a score by at most delta = scale · that · sum_d |k_d|.
    The log-sum-exp then moves by at most delta and each softmax weight by a factor within
    e^(+-2 delta), so the output, a weighted mean of the values, by at most
    (e^(2 delta) - 1) · max|v|. q (L, H, D); k, v (S, Hk, D*) -> bounds on out (L, H, 1) and lse (L, H)."""
    group = q.shape[1] // k.shape[1]
    key_sums = k.double().abs().sum(-1).amax(0).repeat_interleave(group)  # (H,) largest sum_d |k_d|
    v_max = v.double().abs().amax((0, 2)).repeat_interleave(group)  # (H,)
    delta = 1.01 * scale * q.double().abs().amax(-1) / 2**16 * key_sums  # (L, H)
    return (torch.expm1(2 * delta) * v_max)[..., None], delta


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float = 0.0) -> None:
    """|got - want| <= TOL's float32 rounding + bound, elementwise (bound broadcast to want)."""
    err, limit = (got.double() - want).abs(), TOL["atol"] + TOL["rtol"] * want.abs() + bound
    assert bool((err <= limit).all()), f"{int((err > limit).sum())} elements past the bound, by {(err - limit).max()}"
