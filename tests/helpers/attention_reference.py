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
