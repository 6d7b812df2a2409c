"""The attention backend: the one place that decides whether attention runs in
ctxpar's compiled kernels or in PyTorch's ops.

A rank chooses its backend once, at load (``default_backend``: the kernels on a
CPU where they are built and enabled, else PyTorch), and every step carries it
in its ForwardContext (``ctx.attention``). The layers call its entry points and
never ask which one they got:

- ``prefill``: queries that are the last L of S keys, causal bottom-right
  (prompt positions, however the prompt was chunked);
- ``partial``: each query over its own range of the keys (a prefix, or with a
  window the part of it from its first key), with the log-sum-exp a merge needs
  (DCP's partials over a shard);
- ``gqa_prefill_rows`` / ``gqa_partial_rows``: the same over a GQA cache's rows
  as stored, quantized ones read in place where a kernel can;
- ``reads_paged``, ``gqa_decode``, ``latent_decode``: one-query rows over the
  paged cache, every such row of a step in one call where the backend reads the
  cache in place (``reads_paged``), else over their slots padded to a table
  (MLA's latent rows too).

``KernelBackend`` runs each call in a kernel where the kernel takes its shapes
and dtype, and hands the rest to ``TorchBackend``, whose ops it inherits. The
kernels give a query the same bits whichever queries share its call; PyTorch's
kernels choose their blocking by shape. What a layer's attention computes
beyond q·k (its scale, and the variants a model may need: a sliding window, a
soft-capped logit) is its ``AttentionSpec``: a new variant is a field there and
a branch here and in its kernel, not at each call site.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F

from ctxpar import kernels
from ctxpar.errors import CtxparError
from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.layers.attention import torch_ops
from ctxpar.layers.kv_quant import KVQuant

Partials = tuple[torch.Tensor, torch.Tensor]  # out (L, H, out_dim), lse (L, H), float32
# Keys a windowed caller may drop from the front of a prefill's keys, in whole runs, and keep
# its queries' bits (the kernels' blocks stay where they were: attention_kernels.py).
KEY_BLOCK_ALIGN = attn_kernels.KEY_BLOCK_ALIGN


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes: softmax(scale · q·k) over the keys a query sees.

    window: a query at position p sees only the keys at positions (p - window, p], the
    last ``window`` up to its own (a sliding window: transformers' sliding_window and
    llama.cpp's n_swa); soft_cap: the scaled logits pass through
    ``soft_cap · tanh(logit / soft_cap)`` before the softmax (Gemma 2). None: neither."""

    scale: float
    window: int | None = None
    soft_cap: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (
            isinstance(self.window, bool) or int(self.window) != self.window or self.window < 1
        ):
            raise CtxparError(f"an attention window must be a whole number of keys, at least 1; got {self.window!r}")
        if self.soft_cap is not None and not (self.soft_cap > 0 and math.isfinite(self.soft_cap)):
            raise CtxparError(f"an attention soft cap must be a positive finite number; got {self.soft_cap!r}")

    def firsts(self, L: int, S: int, device: torch.device) -> torch.Tensor | None:
        """The first key each of L queries that are the last L of S keys sees (L,) int64,
        or None without a window: query i, at position S - L + i, sees keys from S - L + i + 1 - window."""
        if self.window is None:
            return None
        return (torch.arange(S - L + 1, S + 1, device=device) - self.window).clamp_(min=0)


@dataclass
class DecodeGroup:
    """One-query rows attended in one call."""

    tokens: torch.Tensor  # (B,) int64 local token index of each row's query
    slots: torch.Tensor  # (N,) int64 the rows' cache slots back to back
    starts: torch.Tensor  # (B + 1,) int64 row b's slots are slots[starts[b]:starts[b + 1]]

    @cached_property
    def padded(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, S_max) slot table, short rows padded with their last slot, and the
        keys per row (None when every row has S_max): the PyTorch path's input."""
        table, lengths = torch_ops.padded_slot_table(self.slots, self.starts)
        return table, lengths if bool((lengths != table.shape[1]).any()) else None


class AttentionBackend(Protocol):
    """Where a rank's attention runs (see the module). q, k, v: (tokens, heads, width);
    a GQA cache (num_slots, 2, Hk, D), or its quantized rows (num_slots, row_bytes)."""

    name: str

    def reads_paged(self, cache: torch.Tensor, *widths: int) -> bool:
        """Whether one-query rows over this paged cache, reading these head widths, run
        in one call that reads it in place (all of a step's decodes in one group)."""
        ...

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q (L, H, D) the last L of the keys k (S, Hk, D), values v (S, Hk, Dv), causal
        bottom-right -> (L, H, Dv) in q's dtype, written into ``out`` if given."""
        ...

    def partial(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        counts: torch.Tensor,
        firsts: torch.Tensor | None = None,
    ) -> Partials:
        """Query i over keys [firsts[i], counts[i]) (counts (L,) int64, each in [1, S];
        firsts (L,) int64 in [0, counts[i]], given where spec has a window: only the
        caller knows the keys' positions) -> out (L, H, Dv) and lse (L, H), float32."""
        ...

    def gqa_prefill_rows(
        self, q: torch.Tensor, rows: torch.Tensor, quant: KVQuant | None, spec: AttentionSpec, out: torch.Tensor
    ) -> torch.Tensor:
        """``prefill`` over a GQA cache's rows (S, ...) as stored, into ``out`` (L, H, D)."""
        ...

    def gqa_partial_rows(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        quant: KVQuant | None,
        spec: AttentionSpec,
        counts: torch.Tensor,
        firsts: torch.Tensor | None = None,
    ) -> Partials:
        """``partial`` over a GQA cache's rows (m, ...) as stored."""
        ...

    def gqa_decode(
        self, q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup, spec: AttentionSpec, quant: KVQuant | None
    ) -> Partials:
        """One query per row (B, H, D) over its slots of a GQA cache -> (B, H, D), (B, H);
        with a window, over the last ``spec.window`` of a row's slots (its keys in
        position order, its own last; under DCP the group holds only the window's)."""
        ...

    def latent_decode(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        group: DecodeGroup,
        value_dim: int,
        spec: AttentionSpec,
        quant: KVQuant | None,
    ) -> Partials:
        """MLA in latent space: one query per row (B, H, E) over its slots of latents
        (num_slots, E) that serve as the one shared key, whose first value_dim values are
        the value -> (B, H, value_dim), (B, H)."""
        ...


class TorchBackend:
    """Attention in PyTorch's ops (torch_ops.py): any device, any shape."""

    name = "torch"

    def reads_paged(self, cache: torch.Tensor, *widths: int) -> bool:
        return False

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if spec.window is not None or spec.soft_cap is not None:  # an explicit mask, and capped logits
            L, S = q.shape[0], k.shape[0]
            counts = torch.arange(S - L + 1, S + 1, device=q.device)
            firsts = spec.firsts(L, S, q.device)
            return _into(torch_ops.attention_lse(q, k, v, spec.scale, counts, firsts, spec.soft_cap)[0], q.dtype, out)
        width = v.shape[-1]
        if q.shape[-1] != width:  # PyTorch's CPU kernel needs Q, K and V of one width (MLA's differ)
            d = max(q.shape[-1], width)  # zero dims add nothing to q·k; the scale is explicit
            q, k, v = F.pad(q, (0, d - q.shape[-1])), F.pad(k, (0, d - k.shape[-1])), F.pad(v, (0, d - width))
            return _into(torch_ops.causal(q, k, v, spec.scale)[..., :width], q.dtype, out)
        return _into(torch_ops.causal(q, k, v, spec.scale), q.dtype, out)

    def partial(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        counts: torch.Tensor,
        firsts: torch.Tensor | None = None,
    ) -> Partials:
        return torch_ops.attention_lse(q, k, v, spec.scale, counts, _windowed(spec, firsts), spec.soft_cap)

    def gqa_prefill_rows(
        self, q: torch.Tensor, rows: torch.Tensor, quant: KVQuant | None, spec: AttentionSpec, out: torch.Tensor
    ) -> torch.Tensor:
        kv = rows if quant is None else quant.dequantize(rows).to(q.dtype)
        return self.prefill(q, kv[:, 0], kv[:, 1], spec, out=out)

    def gqa_partial_rows(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        quant: KVQuant | None,
        spec: AttentionSpec,
        counts: torch.Tensor,
        firsts: torch.Tensor | None = None,
    ) -> Partials:
        kv = rows if quant is None else quant.dequantize(rows).to(q.dtype)
        return self.partial(q, kv[:, 0], kv[:, 1], spec, counts, firsts)

    def gqa_decode(
        self, q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup, spec: AttentionSpec, quant: KVQuant | None
    ) -> Partials:
        table, lengths = group.padded
        if quant is None:
            k, v = torch_ops.gather_paged_kv(cache, table)  # (B, Hk, S, D) each
        else:
            B, S = table.shape
            kv = quant.dequantize(cache.index_select(0, table.view(-1))).view(B, S, *quant.entry_shape)
            k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (B, Hk, S, D) each
        return torch_ops.decode_attention(q, k.to(q.dtype), v.to(q.dtype), lengths, *_variant(spec))

    def latent_decode(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        group: DecodeGroup,
        value_dim: int,
        spec: AttentionSpec,
        quant: KVQuant | None,
    ) -> Partials:
        table, lengths = group.padded
        B, S = table.shape
        rows = cache.index_select(0, table.view(-1))
        k = (rows if quant is None else quant.dequantize(rows)).view(B, 1, S, q.shape[-1]).to(q.dtype)
        return torch_ops.decode_attention(q, k, k[..., :value_dim], lengths, *_variant(spec))


class KernelBackend(TorchBackend):
    """ctxpar's compiled kernels (ctxpar/kernels/attention_kernels.py) wherever they take
    the call's shapes and dtype; PyTorch's ops (TorchBackend) for the rest."""

    name = "kernels"

    def reads_paged(self, cache: torch.Tensor, *widths: int) -> bool:
        return attn_kernels.usable(cache, *widths)

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Every CPU call, one query or many, runs in the kernel, which aligns bottom-right
        # itself and gives a query the same bits whatever the queries with it: one path
        # for any L, so a prompt's tokens do not depend on how it was chunked.
        inputs = kernel_inputs(q, k, v)
        if inputs is None:
            return super().prefill(q, k, v, spec, out)
        widths = inputs[2].shape[-1] == v.shape[-1]  # unpadded: the kernel may write into `out`
        direct = out if out is not None and out.dtype == torch.float32 and widths else None
        firsts = spec.firsts(q.shape[0], k.shape[0], q.device)
        result = attn_kernels.prefill_attention(*inputs, spec.scale, out=direct, firsts=firsts, soft_cap=spec.soft_cap)[
            0
        ][..., : v.shape[-1]]
        return _into(result, q.dtype, out)

    def partial(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        counts: torch.Tensor,
        firsts: torch.Tensor | None = None,
    ) -> Partials:
        # In the kernel a query's result depends on its own query, key range and keys only.
        inputs = kernel_inputs(q, k, v)
        if inputs is None:
            return super().partial(q, k, v, spec, counts, firsts)
        firsts = _windowed(spec, firsts)
        out, lse = attn_kernels.prefill_attention(
            *inputs, spec.scale, counts=counts, firsts=firsts, soft_cap=spec.soft_cap
        )
        return out[..., : v.shape[-1]], lse

    def gqa_prefill_rows(
        self, q: torch.Tensor, rows: torch.Tensor, quant: KVQuant | None, spec: AttentionSpec, out: torch.Tensor
    ) -> torch.Tensor:
        if quant is not None and attn_kernels.prefill_quant_usable(q, quant):  # the rows read in place
            firsts = spec.firsts(q.shape[0], rows.shape[0], q.device)
            return attn_kernels.prefill_attention_quant(
                q, rows, quant, spec.scale, out=out, firsts=firsts, soft_cap=spec.soft_cap
            )[0]
        return super().gqa_prefill_rows(q, rows, quant, spec, out)

    def gqa_partial_rows(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        quant: KVQuant | None,
        spec: AttentionSpec,
        counts: torch.Tensor,
        firsts: torch.Tensor | None = None,
    ) -> Partials:
        if quant is not None and attn_kernels.prefill_quant_usable(q, quant):  # the rows read in place
            firsts = _windowed(spec, firsts)
            return attn_kernels.prefill_attention_quant(
                q, rows, quant, spec.scale, counts=counts, firsts=firsts, soft_cap=spec.soft_cap
            )
        return super().gqa_partial_rows(q, rows, quant, spec, counts, firsts)

    def gqa_decode(
        self, q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup, spec: AttentionSpec, quant: KVQuant | None
    ) -> Partials:
        if not self.reads_paged(cache, q.shape[-1]):
            return super().gqa_decode(q, cache, group, spec, quant)
        return attn_kernels.gqa_paged_decode(
            q, cache, group.slots, group.starts, spec.scale, quant, spec.window, spec.soft_cap
        )

    def latent_decode(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        group: DecodeGroup,
        value_dim: int,
        spec: AttentionSpec,
        quant: KVQuant | None,
    ) -> Partials:
        if not self.reads_paged(cache, q.shape[-1], value_dim):
            return super().latent_decode(q, cache, group, value_dim, spec, quant)
        return attn_kernels.latent_paged_decode(
            q, cache, group.slots, group.starts, value_dim, spec.scale, quant, spec.window, spec.soft_cap
        )


TORCH = TorchBackend()
KERNELS = KernelBackend()


def default_backend(device: torch.device) -> AttentionBackend:
    """The backend a rank on ``device`` runs: the kernels on a CPU where they are built
    and enabled (``CTXPAR_KERNELS`` not 0), else PyTorch's ops."""
    return KERNELS if device.type == "cpu" and kernels.available() else TORCH


def _windowed(spec: AttentionSpec, firsts: torch.Tensor | None) -> torch.Tensor | None:
    """A partial's first keys, which a windowed spec needs (a window is positions, and a
    partial's keys are a shard's: its caller alone can say which each query sees)."""
    if spec.window is not None and firsts is None:
        raise ValueError("a partial of a windowed layer needs each query's first key (firsts)")
    return firsts


def _variant(spec: AttentionSpec) -> tuple[float, int | None, float | None]:
    """``decode_attention``'s scale, window and soft cap."""
    return spec.scale, spec.window, spec.soft_cap


def _into(result: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """``result`` in ``dtype``, or copied into ``out`` (unless it is ``out``)."""
    if out is None:
        return result.to(dtype)
    return out if result is out else out.copy_(result)


def kernel_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q, k, v as the compiled prefill kernel takes them, or None where it does not
    run: float32 as they are; bf16 as they are where the CPU has AMX-BF16, else
    widened to float32. Unlike PyTorch's CPU kernel, it takes V narrower than Q and K.
    Widths it does not take are padded with zeros (Q and K to whole vectors or tiles, V
    to whole tiles: 16 or 32, and 64 or 32 values cover every build), which add nothing
    to q·k; the caller cuts the padded value columns off. So every width runs in the
    kernel, whose result for a query does not depend on the queries beside it
    (PyTorch's does: MLA's 24-wide heads)."""
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


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``prefill`` on the default backend of q's device, for callers outside a step
    (calibration, benchmarks, tests): a step's layers call their context's backend."""
    return default_backend(q.device).prefill(q, k, v, AttentionSpec(scale), out)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, counts: torch.Tensor) -> Partials:
    """``partial`` on the default backend of q's device, as ``causal_attention``."""
    return default_backend(q.device).partial(q, k, v, AttentionSpec(scale), counts)
