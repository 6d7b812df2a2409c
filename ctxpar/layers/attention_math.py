"""Attention math on contiguous tensors, each result with what merging needs.

- ``causal_attention``: queries that are the last L of S keys (prefill chunks,
  bottom-right causal);
- ``attention_lse``: attention with its log-sum-exp, each query over its own
  prefix of the keys (DCP's partials);
- ``merge_attention``: the exact merge of partials over disjoint key sets;
- the one rule that sends a call to ctxpar's compiled kernels (``kernel_inputs``
  for query blocks, ``paged_kernel`` for one-query rows over the paged cache).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ctxpar import kernels
from ctxpar.kernels import attention_kernels as attn_kernels


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of L queries that are the *last* L positions of S keys.

    q: (L, H, D)  k: (S, Hk, D)  v: (S, Hk, D)  with H a multiple of Hk (GQA)
    returns (L, H, D) in q's dtype, written into `out` (contiguous) if given

    Query i (absolute position S - L + i) sees keys [0, S - L + i]: causal,
    aligned bottom-right. On the CPU every call runs in ctxpar's compiled kernel
    (``kernel_inputs``), which aligns bottom-right itself and gives a
    query the same bits whatever the queries with it: one path for any L, so a
    prompt's tokens do not depend on how it was chunked. Elsewhere: PyTorch's
    ``is_causal`` aligns top-left, so a continued prefill (0 < S - L, L > 1) is
    split into a mask-free part over the old context and a causal part over the
    new keys, merged by their log-sum-exp: faster than an explicit mask.
    """
    inputs = kernel_inputs(q, k, v)
    if inputs is not None:
        widths = inputs[2].shape[-1] == v.shape[-1]  # unpadded: the kernel may write into `out`
        direct = out if out is not None and out.dtype == torch.float32 and widths else None
        result = attn_kernels.prefill_attention(*inputs, scale, out=direct)[0][..., : v.shape[-1]]
    else:
        result = _torch_causal_attention(q, k, v, scale)
    if out is None:
        return result.to(q.dtype)
    return out if result is out else out.copy_(result)


def kernel_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q, k, v as the compiled prefill kernel takes them, or None where it does not
    run (``causal_attention`` and DCP's ``attention_lse``): float32 as they are; bf16
    as they are where the CPU has AMX-BF16, else widened to float32. Unlike PyTorch's
    CPU kernel, it takes V narrower than Q and K. Widths it does not take are padded
    with zeros (Q and K to whole vectors or tiles, V to whole tiles: 16 or 32, and 64
    or 32 values cover every build), which add nothing to q·k; the caller cuts the
    padded value columns off. So every width runs in the kernel, whose result for a
    query does not depend on the queries beside it (PyTorch's does: MLA's 24-wide heads)."""
    if q.device.type != "cpu" or not kernels.available() or q.dtype not in (torch.float32, torch.bfloat16):
        return None
    if q.dtype == torch.bfloat16:
        tiles = _padded(q, k, v, 32, 32)
        if attn_kernels.prefill_usable(*tiles):
            return tiles
        q, k, v = q.float(), k.float(), v.float()
    widened = _padded(q, k, v, 16, 64)
    return widened if attn_kernels.prefill_usable(*widened) else None


def _padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_to: int, v_to: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k zero-padded to a multiple of qk_to values per head, v of v_to."""
    pad_qk, pad_v = -q.shape[-1] % qk_to, -v.shape[-1] % v_to
    if pad_qk:
        q, k = F.pad(q, (0, pad_qk)), F.pad(k, (0, pad_qk))
    if pad_v:
        v = F.pad(v, (0, pad_v))
    return q, k, v


def paged_kernel(cache: torch.Tensor, *widths: int) -> bool:
    """Whether one-query rows over this paged cache run in the compiled decode
    kernel (widths: the head widths it reads, see ``attn_kernels.usable``)."""
    return attn_kernels.usable(cache, *widths)


def _torch_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """causal_attention with PyTorch's kernels."""
    L, S = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if L == S or L == 1:
        out = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, is_causal=L > 1, scale=scale, enable_gqa=kh.shape[1] != qh.shape[1]
        )
        return out[0].transpose(0, 1)
    if q.device.type != "cpu":
        return lower_right_sdpa(qh, kh, vh, scale)[0].transpose(0, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, _ = bottom_right_causal(  # (1, H, L, D)
        L, S, lambda keys, causal: flash(qh, kh[:, :, keys], vh[:, :, keys], 0.0, causal, scale=scale)[:2]
    )
    return out[0].transpose(0, 1).to(q.dtype)


def lower_right_sdpa(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch's SDPA of queries (B, H, L, D) that are the last L of S keys (B, Hk, S, D),
    causal aligned bottom-right: the path off the CPU, where the flash and
    memory-efficient kernels mask so natively (elsewhere, e.g. fp32 with GQA, the mask
    is materialized). It also runs on the CPU, where its tests run."""
    from torch.nn.attention.bias import causal_lower_right

    L, S = qh.shape[-2], kh.shape[-2]
    return torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=causal_lower_right(L, S), scale=scale, enable_gqa=kh.shape[1] != qh.shape[1]
    )


def bottom_right_causal(
    L: int, S: int, attend: Callable[[slice, bool], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries that are the last L of S keys, aligned
    bottom-right, from ``attend(keys, causal) -> (out, lse)`` over a slice of
    the keys whose ``causal`` aligns top-left: an unmasked part over the first
    S - L keys and a causal square over the last L, merged exactly."""
    if L == S:
        return attend(slice(0, S), True)
    early, square = attend(slice(0, S - L), False), attend(slice(S - L, S), True)
    return merge_attention(torch.stack([early[0], square[0]]), torch.stack([early[1], square[1]]))


def merge_attention(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over K disjoint key sets:
    ``L = logsumexp_k lse_k``, ``out = Σ_k exp(lse_k − L) · out_k``.

    outs (K, ..., D), lses (K, ...) natural-log sums of exp scores -> out
    (..., D) (in the promoted dtype of outs and lses), lse (...). A part with
    lse -inf (no keys) weighs nothing; if all are, out is 0 and lse -inf (no NaN).
    The sums run over k in order, element by element, so an element's result
    depends on its own parts only (DCP merges a query's shards with it).
    """
    top = lses.amax(0)
    top = torch.where(top.isfinite(), top, 0.0)
    w = torch.exp(lses - top)  # (K, ...): exp(-inf) = 0
    total, out = w[0], outs[0] * w[0].unsqueeze(-1)
    for k in range(1, len(w)):
        total, out = total + w[k], out + outs[k] * w[k].unsqueeze(-1)
    return out / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1), top + torch.log(total)


# Scores the PyTorch path of attention_lse holds at once: queries are taken in blocks
# of about this many (query, head, key) scores.
SCORES_PER_BLOCK = 1 << 24


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp, each query over a prefix of the keys (DCP: a
    shard's keys up to the query's position). q (L, H, D), k (m, Hk, D), v (m, Hk, Dv)
    with H a multiple of Hk; counts (L,) int64: query i sees keys [0, counts[i]),
    1 <= counts[i] <= m.

    Returns out (L, H, Dv) and lse (L, H), both float32. In the compiled prefill
    kernel a query's result depends on its own query, count and keys only.
    """
    inputs = kernel_inputs(q, k, v)
    if inputs is not None:
        out, lse = attn_kernels.prefill_attention(*inputs, scale, counts=counts)
        return out[..., : v.shape[-1]], lse
    L, m, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    kh, vh = k.transpose(0, 1).repeat_interleave(rep, 0).float(), v.transpose(0, 1).repeat_interleave(rep, 0).float()
    outs, lses = [], []
    step = max(1, SCORES_PER_BLOCK // max(1, q.shape[1] * m))
    for a in range(0, L, step):
        qh = q[a : a + step].transpose(0, 1).float()  # (H, l, D)
        s = (qh @ kh.transpose(-1, -2)) * scale  # (H, l, m)
        hidden = torch.arange(m, device=q.device) >= counts[a : a + step, None].to(q.device)  # (l, m)
        s = s.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(s, -1)  # (H, l)
        outs.append((torch.exp(s - lse.unsqueeze(-1)) @ vh).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)
