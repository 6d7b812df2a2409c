"""Multi-head latent attention (MLA) of DeepSeek-V2/V3, over ctxpar's paged cache.

Per token, the layer caches one vector of ``kv_lora_rank + qk_rope_head_dim``
values: the normalised latent ``c_kv`` and the roped key part ``k_pe`` that is
shared by all heads. Keys and values of head h are ``k = [W_UK[h] c_kv, k_pe]``
and ``v = W_UV[h] c_kv``, where ``kv_b_proj.weight`` stacks (W_UK[h]; W_UV[h])
per head.

Two equivalent ways to attend a row over its cached context:

- **expanded** (prefill): up-project the context latents through kv_b_proj to
  per-head k_nope and v, append the broadcast rope key, and run ordinary
  attention. ctxpar's compiled kernel takes v narrower than q/k; PyTorch's
  CPU kernel needs equal head sizes, so its backend zero-pads v (or q/k,
  whichever is narrower) and slices the output (ctxpar/layers/attention/backend.py).
- **absorbed** (decode): fold W_UK into the query (``q_lat = q_nope W_UK``) and
  attend in latent space with one shared KV head whose key *and* value are the
  cached entry itself; the first ``kv_lora_rank`` output values are then
  up-projected through W_UV. Per decode token this costs O(context · latent)
  instead of up-projecting the whole context.

``MLAttention`` is an ``AttentionKind`` (ctxpar/layers/attention/attend.py): its
queries are [q_nope | roped q_pe] per head and its cache entries the latents;
``attend`` chooses between the full cache and DCP's shards, where every shard
is attended in latent space.

``ATTENTION_PATH`` picks the path: "auto" (absorbed for queries past their
prompt, decodes and drafts; expanded for prompt positions, however the prompt
is chunked, so a token takes one path), or "absorbed"/"expanded" to force one
(tests compare them).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ctxpar.layers.attention.attend import attend
from ctxpar.layers.attention.backend import AttentionBackend, AttentionSpec, DecodeGroup, Partials
from ctxpar.layers.attention.paged import decode_batch, prompt_spans
from ctxpar.layers.forward_context import ForwardContext, from_cache
from ctxpar.layers.kv_quant import KVQuant
from ctxpar.layers.linear import Linear, Weight, can_pack, linear, pack_linears, packed
from ctxpar.layers.norm import RMSNorm
from ctxpar.layers.rotary import apply_rotary

ATTENTION_PATH = "auto"  # "auto" | "absorbed" | "expanded"


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for scaled rope.

    Exactly transformers' ``yarn_apply_mscale`` (DeepSeek-V2 and -V3 alike): the
    correction applies to any rope_type other than "default" whose parameters
    set a non-zero ``mscale_all_dim`` (in practice: yarn).
    """
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            factor = params.get("factor")
            if factor is None:  # as transformers' yarn rope derives it
                factor = config.max_position_embeddings / params["original_max_position_embeddings"]
            m = yarn_get_mscale(factor, mscale_all_dim)
            scale = scale * m * m
    return scale


class MLAttention(nn.Module):
    """hidden (n, H) -> attention output (n, H); caches (n, kv_lora_rank + rope) latents."""

    def __init__(self, config, layer_idx: int, rope_interleaved: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.v_head_dim = config.v_head_dim
        self.rope_interleaved = rope_interleaved
        self.spec = AttentionSpec(mla_softmax_scale(config))
        bias = bool(getattr(config, "attention_bias", False))
        H, h = config.hidden_size, self.num_heads
        if self.q_lora_rank is None:
            self.q_proj = Linear(H, h * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(H, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # transformers: default eps, not rms_norm_eps
            self.q_b_proj = Linear(self.q_lora_rank, h * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(H, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = Linear(h * self.v_head_dim, H, bias=bias)
        self.heads_packed: tuple[list[Weight], list[Weight]] | None = None  # see pack

    # -- weights seen per head -------------------------------------------------
    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as (h, nope, r) key and (h, v, r) value up-projections (views)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def pack(self) -> None:
        """After loading: every projection packed (``pack_linears``), and kv_b_proj's per-head
        up-projections as weights of their own, (r, nope) W_UK^T and (v, r) W_UV, which the
        absorbed path multiplies by through ``linear``: the panel kernel, whose result for a
        row does not depend on the rows beside it (``torch.bmm``'s does)."""
        w_uk, w_uv = self._w_uk_uv()
        if can_pack(w_uk):
            heads = range(self.num_heads)
            uk = [packed(w_uk[i].t().contiguous()) for i in heads]
            self.heads_packed = (uk, [packed(w_uv[i].contiguous()) for i in heads])
        pack_linears(self)

    def _per_head(self, x: torch.Tensor, weights: list[Weight]) -> torch.Tensor:
        """x (L, h, d) -> (L, h, out): head i's rows through weights[i]."""
        return torch.stack([linear(x[:, i].contiguous(), w) for i, w in enumerate(weights)], dim=1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, h = x.shape[0], self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, h, self.qk_head_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = apply_rotary(q_pe, cos, sin, self.rope_interleaved)

        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        k_pe = apply_rotary(k_pe.unsqueeze(1), cos, sin, self.rope_interleaved).squeeze(1)
        entries = torch.cat([c_kv, k_pe], dim=-1)  # (n, r + rope)
        out = attend(torch.cat([q_nope, q_pe], dim=-1), entries, ctx, self)  # (n, h, v)
        return self.o_proj(out.reshape(n, h * self.v_head_dim))

    # -- AttentionKind: queries (n, h, nope + rope), entries (n, r + rope) -------
    @property
    def out_dim(self) -> int:
        return self.v_head_dim

    @property
    def paged_widths(self) -> tuple[int, ...]:
        return (self.kv_lora_rank + self.rope_dim, self.kv_lora_rank)  # the latent key, and its value part

    @property
    def turns_quantized_heads(self) -> bool:
        return False  # one latent shared by every head, whose up-projections are absorbed into the queries

    def attend_cache(self, q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Batched one-query rows in latent space, other rows by ATTENTION_PATH."""
        n, h = q.shape[0], self.num_heads
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        out = q.new_zeros(n, h, self.v_head_dim)
        backend = ctx.attention
        in_place = backend.reads_paged(cache, *self.paged_widths)
        dec = decode_batch(ctx, in_place) if ATTENTION_PATH != "expanded" else None
        for grp in dec.groups if dec is not None else []:  # one-query rows in batches, in latent space
            q_lat = self._absorb_query(q_nope.index_select(0, grp.tokens), q_pe.index_select(0, grp.tokens))
            o, _ = backend.latent_decode(q_lat, cache, grp, self.kv_lora_rank, self.spec, ctx.kv_quant)
            out.index_copy_(0, grp.tokens, self._unabsorb(o.to(q_lat.dtype)))
        # "auto" up-projects every prompt query (a prompt position takes one path however
        # its prompt is chunked); decodes attend in latent space above.
        attend_row = self._absorbed if ATTENTION_PATH == "absorbed" else self._expanded
        for a, b, slots in prompt_spans(ctx, dec):
            # Up-projecting (expanded) needs float latents: a quantized row's are dequantized.
            context = from_cache(cache.index_select(0, slots), ctx, q.dtype)
            out[a:b] = attend_row(backend, q_nope[a:b], q_pe[a:b], context)
        return out

    def shard_query(self, q: torch.Tensor) -> torch.Tensor:
        """Every shard is attended in latent space (the absorbed path)."""
        return self._absorb_query(*q.split([self.nope_dim, self.rope_dim], dim=-1))

    def _expanded(
        self, backend: AttentionBackend, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        """q_nope (L, h, nope), q_pe (L, h, rope), kv (S, r + rope) -> (L, h, v): V narrower
        than Q and K, which the backend takes as it is (ctxpar's kernel) or pads (PyTorch's)."""
        S, h = kv.shape[0], self.num_heads
        c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_up = self.kv_b_proj(c_kv).view(S, h, self.nope_dim + self.v_head_dim)
        k_nope, v = kv_up.split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(S, h, self.rope_dim)], dim=-1)
        return backend.prefill(torch.cat([q_nope, q_pe], dim=-1), k, v.contiguous(), self.spec)

    def _absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """(L, h, nope), (L, h, rope) -> latent-space query (L, h, r + rope): q_nope through W_UK."""
        if self.heads_packed is not None:
            q_lat = self._per_head(q_nope, self.heads_packed[0])  # (L, h, r)
        else:
            w_uk, _ = self._w_uk_uv()
            q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        return torch.cat([q_lat, q_pe], dim=-1)

    def attend_lse(
        self,
        backend: AttentionBackend,
        q: torch.Tensor,
        kv: torch.Tensor,
        counts: torch.Tensor,
        quant: KVQuant | None,
        firsts: torch.Tensor | None = None,
    ) -> Partials:
        """(out (L, h, v), lse (L, h)) of latent queries (L, h, r + rope), query i over the
        first counts[i] latents of (m, r + rope) (from firsts[i], if given), or of their quantized rows
        (``AttentionKind.attend_lse``). W_UV is linear, so applying it before the cross-rank
        combine is exact, and partials travel at v_head_dim, not kv_lora_rank."""
        if quant is not None:  # the latents are dequantized for the product
            kv = quant.dequantize(kv).to(q.dtype)
        k = kv.unsqueeze(1)  # one KV head, key doubles as value
        o, lse = backend.partial(q, k, k, self.spec, counts, firsts)
        return self._unabsorb(o[..., : self.kv_lora_rank].to(q.dtype)), lse

    def decode_lse(
        self, backend: AttentionBackend, q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup, quant: KVQuant | None
    ) -> Partials:
        """One-query latent rows over their shards in one call, then W_UV, as ``attend_lse``
        (``AttentionKind.decode_lse``)."""
        o, lse = backend.latent_decode(q, cache, group, self.kv_lora_rank, self.spec, quant)
        return self._unabsorb(o.to(q.dtype)), lse

    def _unabsorb(self, o: torch.Tensor) -> torch.Tensor:
        """Latent attention output (L, h, r) through W_UV -> (L, h, v)."""
        if self.heads_packed is not None:
            return self._per_head(o, self.heads_packed[1])
        _, w_uv = self._w_uk_uv()
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _absorbed(
        self, backend: AttentionBackend, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        """Attention in latent space: same result as _expanded, without up-projecting the context."""
        L, S, h = q_nope.shape[0], kv.shape[0], self.num_heads
        q = self._absorb_query(q_nope, q_pe)  # (L, h, r + rope)
        k = kv.unsqueeze(1)  # (S, 1, r + rope): one KV head, key doubles as value
        if 1 < L < S:  # continued-prefill kernels on CPU take no GQA: expand the single head
            k = k.expand(S, h, k.shape[-1])
        return self._unabsorb(backend.prefill(q, k, k, self.spec)[..., : self.kv_lora_rank])  # (L, h, v)
