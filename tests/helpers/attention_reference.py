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
