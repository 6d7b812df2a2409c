"""What one forward pass needs to know besides the token ids: the rank-local
rows, where their KV lives in the paged cache, and how to gather KV over ranks.

The model runner builds one ``ForwardContext`` per step; attention layers read
it and nothing else, so they know only "gather my KV inputs, write them,
attend" (DESIGN.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ctxpar import kernels

if TYPE_CHECKING:
    from ctxpar.layers.dcp import DCPStep

# Causal rows of at least this many queries run in the compiled kernel; shorter
# ones in PyTorch's (its call costs less). Kernel / PyTorch time, SmolLM2 shapes,
# 2 threads: 32 queries 1.34x, 64 0.83x, 128 0.71x, 2048 of 2048 keys 0.73x.
KERNEL_MIN_QUERIES = 64


@dataclass
class ForwardContext:
    # Local rows (this rank). A row is a contiguous run of one request's tokens.
    query_start_loc: list[int]  # (rows + 1,) local token range of each row
    start_pos: list[int]  # (rows,) absolute position of each row's first token
    seq_lens: list[int]  # (rows,) start_pos + num_tokens: keys each row attends to
    context_slots: list[torch.Tensor]  # rows x (seq_len,) int64 cache slot of positions [0, seq_len)
    # Cache writes: rows of the (gathered) KV entries to store, and where.
    write_src: torch.Tensor | None  # (W,) int64 index into the entries; None = all of them, in order
    write_slots: torch.Tensor  # (W,) int64 flat slot in each layer's cache
    kv_caches: list[torch.Tensor]  # per layer: (num_slots, *kv_entry_shape)
    # All-gather over the PCP group: (n, ...) -> (P*n, ...). None: KV stays local.
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Decode context parallelism: the cache holds this rank's shard only, and the
    # layers attend through ctxpar.layers.dcp (context_slots unused). None: a full cache.
    dcp: DCPStep | None = None
    # Per-step values that every layer would otherwise rebuild (e.g. the decode batch's
    # slot table, ctxpar/layers/paged_attention.py): filled by the first layer that needs them.
    memo: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.start_pos)


def gather_and_store_kv(entries: torch.Tensor, ctx: ForwardContext, layer_idx: int) -> torch.Tensor:
    """All-gather this step's KV-cache entries of one layer over the ranks (a
    split step), then write them; returns the layer's cache (num_slots, *E).

    entries: (n, *E) the KV-cache inputs of the local (padded) tokens; E is the
    per-token entry shape of the layer (GQA: (2, kv_heads, head_dim); MLA:
    (kv_lora_rank + rope_dim,)). The context of a row includes the other
    ranks' chunks of this very step, which is why every rank gathers and
    writes before anyone attends.
    """
    if ctx.gather is not None:
        entries = ctx.gather(entries)  # (P*n, *E)
    return store_kv(entries, ctx, layer_idx)


def store_kv(entries: torch.Tensor, ctx: ForwardContext, layer_idx: int) -> torch.Tensor:
    """Write the step's entries (already gathered, if the step gathers) that
    this rank stores into layer ``layer_idx``'s cache; returns that cache."""
    cache = ctx.kv_caches[layer_idx]
    if ctx.write_src is not None:
        entries = entries.index_select(0, ctx.write_src)
    cache.index_copy_(0, ctx.write_slots, entries.to(cache.dtype))
    return cache


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of L queries that are the *last* L positions of S keys.

    q: (L, H, D)  k: (S, Hk, D)  v: (S, Hk, D)  with H a multiple of Hk (GQA)
    returns (L, H, D), written into `out` (contiguous) if given

    Query i (absolute position S - L + i) sees keys [0, S - L + i]: causal,
    aligned bottom-right. On the CPU in fp32, rows of at least
    KERNEL_MIN_QUERIES queries run in ctxpar's compiled kernel, which aligns
    bottom-right itself. Otherwise: PyTorch's ``is_causal`` aligns top-left, so a
    continued prefill (0 < S - L, L > 1) is split into a mask-free part over
    the old context and a causal part over the new keys, merged by their
    log-sum-exp: ~1.5x faster on CPU than an explicit mask.
    """
    if takes_kernel(q, k, v):
        return kernels.prefill_attention(q, k, v, scale, out=out)[0]
    result = _torch_causal_attention(q, k, v, scale)
    return result if out is None else out.copy_(result)


def takes_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether attention of these runs in the compiled kernel (``causal_attention``
    and DCP's ``attention_lse``): rows of at least KERNEL_MIN_QUERIES queries the
    kernel takes. Unlike PyTorch's CPU kernel, it takes V narrower than Q and K."""
    return q.shape[0] >= KERNEL_MIN_QUERIES and kernels.prefill_usable(q, k, v)


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
        # CUDA kernels implement bottom-right causal masking natively.
        from torch.nn.attention.bias import causal_lower_right

        out = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=causal_lower_right(L, S), scale=scale, enable_gqa=kh.shape[1] != qh.shape[1]
        )
        return out[0].transpose(0, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, _ = bottom_right_causal(  # (1, H, L, D)
        L, S, lambda keys, causal: flash(qh, kh[:, :, keys], vh[:, :, keys], 0.0, causal, scale=scale)[:2]
    )
    return out[0].transpose(0, 1).to(q.dtype)


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
    """
    top = lses.amax(0)
    top = torch.where(top.isfinite(), top, 0.0)
    w = torch.exp(lses - top)  # (K, ...): exp(-inf) = 0
    total = w.sum(0)
    out = (outs * w.unsqueeze(-1)).sum(0) / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1)
    return out, top + torch.log(total)
