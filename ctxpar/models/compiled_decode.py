"""A Llama-style decode step's layers in one compiled call (kernels/decode_loop.cpp).

The CPU's counterpart of CUDA graphs: a decode step of a small model is a few
hundred kernel calls, and from Python each costs ~10 us beyond its kernel
(a third of SmolLM2's step). A model describes its decode step once, as a
``DecoderStep`` (ctxpar/models/llama.py's ``fast_decode``): its widths, which
also bound its CUDA graphs' memory, and each layer's weights in the order the
step runs them. ``CompiledDecode`` is built once per rank from that description
and the KV caches: it records every layer's weight and cache pointers, and runs
a step whose rows are all decodes as one call that makes the same kernel calls
with the same arguments, in the same order, as the model's forward does. The
outputs are therefore the same bits (tests/models/test_compiled_decode.py
compares the two). A layer whose MLP is a mixture of experts (Qwen-MoE's,
``DecoderExperts``) routes each row and runs its experts in the loop, in the
order and with the kernels of the expert layer's forward (ctxpar/layers/moe.py).

Everything else (prefill, split or gathered steps, DCP, weights or caches the
kernels do not read, ``enforce_eager=True``) runs the model's own forward;
``build`` returns None where the loop does not apply at all, and ``serves``
says whether it applies to a step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ctxpar import kernels
from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.layers import kv_rotation
from ctxpar.layers.attention.backend import AttentionSpec
from ctxpar.layers.attention.paged import decode_batch
from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.kv_quant import KVQuant
from ctxpar.layers.linear import embedding
from ctxpar.layers.norm import RMSNorm
from ctxpar.layers.quant_linear import QuantWeight
from ctxpar.models.base import DecodeShape
from ctxpar.models.compiled_experts import (
    DecoderExperts,
    Projection,
    ProjectionRecord,
    address,
    experts_record,
    projection_record,
)

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
Rotary = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # positions (n,) -> cos, sin (n, rot / 2)


def _turned(rotary: Rotary) -> int:
    """The dims of each head ``rotary`` turns: its tables' width twice."""
    return 2 * rotary(torch.zeros(1, dtype=torch.int64))[0].shape[-1]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", ProjectionRecord),
        ("o", ProjectionRecord),
        ("gate_up", ProjectionRecord),
        ("down", ProjectionRecord),
        ("cache", _ptr),
        ("window", _i64),  # a sliding-window layer's keys per query; 0: every key
        ("q_norm", _ptr),  # (head_dim,) each; null: no norms of the heads
        ("k_norm", _ptr),
        ("attn_out_norm", _ptr),  # (hidden,) each; null: none
        ("mlp_out_norm", _ptr),
        ("local_rope", _i64),
        ("rot", _i64),  # each Q, K head's first rot dims turn (rot < head_dim: a partial rotary factor's)
        ("experts", _ptr),  # an _Experts in the MLP's place; null: the dense gate_up, down
    ]


class _Cache(ctypes.Structure):
    # q_turn, kv_turn: kv_rotation.scales of a quantized cache whose heads are turned; 0: not turned.
    _fields_ = [
        ("code", _i64),
        ("row_bytes", _i64),
        ("scale_offset", _i64),
        ("num_runs", _i64),
        ("runs", _ptr),
        ("q_turn", ctypes.c_float),
        ("kv_turn", ctypes.c_float),
    ]


@dataclass(frozen=True, repr=False)  # its tensors are weights: no repr of their values
class DecoderLayer:
    """One Llama-style decoder layer as its decode step runs it: h += [RMSNorm](O(attend(rope(
    [norm each Q, K head](QKV(RMSNorm(h))))))), then h += [RMSNorm](down(act·up(gate_up(
    RMSNorm(h))))); each projection a weight and its bias (None: none), each bracketed norm
    one a model may have (Gemma's sandwich norms, Qwen3's and Gemma 3's head norms); a
    mixture of experts' layer has ``experts`` where the dense one has gate_up and down."""

    input_norm: torch.Tensor  # (hidden,)
    qkv: Projection  # rows [q | k | v]
    o: Projection
    post_norm: torch.Tensor  # (hidden,) of h after the attention's residual add (the MLP's input)
    gate_up: Projection | None  # rows [gate | up]; None: experts
    down: Projection | None
    window: int | None = None  # a sliding-window layer's (AttentionSpec.window); None: every key
    q_norm: torch.Tensor | None = None  # (head_dim,) the RMSNorm of each Q head (Qwen3); None: none
    k_norm: torch.Tensor | None = None  # (head_dim,) of each K head; both or neither
    attn_out_norm: torch.Tensor | None = None  # (hidden,) of the attention's output before its residual add
    mlp_out_norm: torch.Tensor | None = None  # (hidden,) of the MLP's output before its residual add
    local_rope: bool = False  # rope by the step's ``local_rotary`` (Gemma 3's sliding layers)
    experts: DecoderExperts | None = None  # in the dense MLP's place


@dataclass(frozen=True, repr=False)
class DecoderStep:
    """A Llama-style model's decode step, described once: what its fast paths derive from."""

    shape: DecodeShape
    eps: float  # the RMSNorms'
    spec: AttentionSpec  # the layers' scale and soft cap (a layer's window is its DecoderLayer's)
    turns_quantized_heads: bool  # a quantized cache holds its heads turned (kv_rotation.py)
    embed: torch.Tensor | QuantWeight  # (vocab, hidden)
    norm: RMSNorm  # the final one
    rotary: Rotary
    layers: list[DecoderLayer]
    local_rotary: Rotary | None = None  # the rope of the layers marked local_rope
    gelu: bool = False  # the MLP's activation gelu_tanh(gate) * up (Gemma), else SiLU's
    embed_scale: torch.Tensor | None = None  # () the embeddings' factor (Gemma: sqrt(hidden)); None: 1


@dataclass
class CompiledDecode:
    """The decode loop of one model's ``DecoderStep`` over its KV caches (see the module)."""

    step: DecoderStep
    layers: Any  # ctypes array of _Layer, one per decoder layer
    cache: _Cache
    runs: torch.Tensor | None  # the quantized cache's runs (kept alive: the loop reads them)
    experts: list[Any]  # the layers' _Experts and their ProjectionRecord arrays (kept alive: the loop reads them)

    @classmethod
    def build(cls, step: DecoderStep, kv_caches: list[torch.Tensor], kv_quant: KVQuant | None) -> CompiledDecode | None:
        """The loop of ``step`` (a loaded model's, weights in place for good) over its caches, or None."""
        if not kernels.available() or step.norm.weight.dtype != torch.float32:
            return None
        if not all(attn_kernels.usable(c, step.shape.head_dim) for c in kv_caches):  # read in place
            return None
        rot, local_rot = (0 if r is None else _turned(r) for r in (step.rotary, step.local_rotary))
        records: list[_Layer] = []
        kept: list[Any] = []
        for layer, cache in zip(step.layers, kv_caches):
            mlp = (layer.gate_up, layer.down)
            projections = tuple(projection_record(*p) if p else ProjectionRecord() for p in (layer.qkv, layer.o, *mlp))
            experts = None if layer.experts is None else experts_record(layer.experts, kept)
            if any(p is None for p in projections) or (layer.experts is not None and experts is None):
                return None
            norms = (layer.input_norm, layer.post_norm)
            heads = (address(layer.q_norm), address(layer.k_norm))
            sandwich = (address(layer.attn_out_norm), address(layer.mlp_out_norm))
            rope = (int(layer.local_rope), local_rot if layer.local_rope else rot)
            fields = (address(cache), layer.window or 0, *heads, *sandwich, *rope, experts)
            records.append(_Layer(*(address(w) for w in norms), *projections, *fields))
        if kv_quant is None:
            runs, fmt = None, _Cache(-1, 0, 0, 0, None, 0.0, 0.0)
        else:
            runs = torch.tensor(kv_quant.runs, dtype=torch.int64)
            code = attn_kernels.CODES[kv_quant.codes]
            q_turn, kv_turn = kv_rotation.scales(step.shape.head_dim) if step.turns_quantized_heads else (0.0, 0.0)
            fmt = _Cache(code, kv_quant.row_bytes, kv_quant.scale_offset, len(runs), runs.data_ptr(), q_turn, kv_turn)
        return cls(step, (_Layer * len(records))(*records), fmt, runs, kept)

    def serves(self, ctx: ForwardContext, num_tokens: int) -> bool:
        """Whether this step is one the loop computes as the model's forward would: every
        local token a decode-kernel query, written to its own slot, nothing gathered."""
        if ctx.gather is not None or ctx.dcp is not None or ctx.write_src is not None:
            return False
        batch = decode_batch(ctx, True)
        return batch is not None and batch.whole and num_tokens == ctx.query_start_loc[-1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The model's forward for a step ``serves`` accepts: (n,) ids and positions -> (n, hidden)."""
        m, s = self.step, self.step.shape
        h = embedding(input_ids, m.embed, m.norm.weight.dtype).contiguous()  # (n, hidden)
        if m.embed_scale is not None:
            h.mul_(m.embed_scale.to(h.dtype))
        cos, sin = (t.contiguous() for t in m.rotary(positions))  # (n, rot / 2) each
        local_cos, local_sin = (
            (None, None) if m.local_rotary is None else (t.contiguous() for t in m.local_rotary(positions))
        )
        batch = decode_batch(ctx, True)
        assert batch is not None
        group = batch.groups[0]
        write_slots = ctx.write_slots.contiguous()
        kernels.loaded().llama_decode_layers(
            ctypes.addressof(self.layers),
            len(self.layers),
            ctypes.addressof(self.cache),
            h.data_ptr(),
            h.shape[0],
            s.hidden,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.intermediate,
            m.eps,
            cos.data_ptr(),
            sin.data_ptr(),
            address(local_cos),
            address(local_sin),
            write_slots.data_ptr(),
            group.slots.data_ptr(),
            group.starts.data_ptr(),
            m.spec.scale,
            m.spec.soft_cap or 0.0,
            int(m.gelu),
        )
        return m.norm(h)
