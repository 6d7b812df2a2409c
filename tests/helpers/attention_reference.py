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


def int8_bounds(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, seen: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """How far the prefill kernel over int8 rows (kernels/prefill_attention.cpp) may be from
    exact attention over the rows' values, beyond float32 rounding. q (L, H, D); k, v (S, Hk,
    D*) the values; seen (L, S): which keys each query sees (default: the bottom-right causal
    mask, as ``reference``) -> bounds on out (L, H, Dv) and lse (L, H).

    Its queries are rounded to int16 codes, a step of max|q| / 32767 a row: an element moves
    by at most half a step, 2^-16 of max|q| (1% more for the float quotient rounded before
    the integer), so a score by at most delta = scale · that · sum_d |k_d|. The log-sum-exp
    then moves by at most delta and each softmax weight by a factor within e^(+-2 delta): the
    output, a weighted mean of the values, by at most (e^(2 delta) - 1) · max|v|.
    P · V rounds each row's weights of a block of 64 keys (p_s times the value's scale c_s) to
    int16 codes, a step of the block's largest: with P_s the softmax weights, dim d of the
    output moves by at most 2^-16 · sum over blocks of max_s (P_s c_s) · sum_s |v_s,d| / c_s,
    times e^(2 delta) for the weights' own error. A value's scale is max_d |v_s,d| / 127 (the
    quantizer's code of the largest is 127)."""
    (L, H, _), (S, Hk, _) = q.shape, k.shape
    q, k, v = q.double(), k.double().repeat_interleave(H // Hk, 1), v.double().repeat_interleave(H // Hk, 1)
    if seen is None:
        seen = torch.arange(S)[None, :] <= (S - L + torch.arange(L))[:, None]
    delta = 1.01 * scale * q.abs().amax(-1) / 2**16 * k.abs().sum(-1).amax(0)  # (L, H)
    scores = torch.einsum("lhd,shd->lhs", q, k).masked_fill(~seen[:, None, :], float("-inf")) * scale
    weights = torch.softmax(scores, -1).nan_to_num(0.0)  # (L, H, S)
    c = v.abs().amax(-1) / 127  # (S, H)
    blocks = -(-S // 64)
    pad = (0, blocks * 64 - S)
    w_max = torch.nn.functional.pad(weights * c.T, pad).view(L, H, blocks, 64).amax(-1)  # (L, H, blocks)
    codes = (v.abs() / c[..., None]).nan_to_num(0.0)  # (S, H, Dv) |codes|
    code_sums = torch.nn.functional.pad(codes.permute(1, 2, 0), pad).view(H, -1, blocks, 64).sum(-1)  # (H, Dv, blocks)
    pv = torch.einsum("lhb,hdb->lhd", w_max, code_sums) * 1.01 / 2**16 * torch.exp(2 * delta)[..., None]
    return torch.expm1(2 * delta)[..., None] * v.abs().amax((0, 2))[:, None] + pv, delta


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float = 0.0) -> None:
    """|got - want| <= TOL's float32 rounding + bound, elementwise (bound broadcast to want)."""
    err, limit = (got.double() - want).abs(), TOL["atol"] + TOL["rtol"] * want.abs() + bound
    assert bool((err <= limit).all()), f"{int((err > limit).sum())} elements past the bound, by {(err - limit).max()}"
