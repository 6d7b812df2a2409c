"""The Llama family in one implementation: Llama (any rope scaling, e.g. llama3),
Qwen2 (QKV bias), Qwen3 (per-head q/k RMSNorm, explicit head_dim), Phi-3 (its
checkpoints' Q|K|V and gate|up fused) and SmolLM2 (Llama with tied embeddings);
Qwen-MoE's layers with experts in the MLP's place (models/qwen_moe.py).

RMSNorm, SwiGLU MLP, grouped-query attention. Projections are fused: one
matmul for Q, K and V, one for gate and up. Attention is project -> norm -> rope -> attend -> project:
``ctxpar.layers.attention.attend`` takes the queries and the K/V cache entries
of the local tokens and deals with the ranks and the paged cache. Rope turns
Q and K in place inside the QKV projection, whose K|V half is then the cache
entry as is; on the CPU in fp32 the elementwise steps (RMSNorm with the
residual add before it, rope, SiLU·up) are one compiled pass each
(ctxpar/kernels/elementwise.py). Its decode step, described once (``decode_step``),
gives both fast paths (``fast_decode``): the CPU's compiled loop and the bound of
a GPU's CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from ctxpar.errors import CtxparError
from ctxpar.layers.activation import silu_and_mul
from ctxpar.layers.attention.attend import GQA, attend
from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.kv_quant import default_runs
from ctxpar.layers.linear import (
    MLP_ROWS,
    Weight,
    can_pack,
    embedding,
    linear,
    pack_linears,
    pack_weight,
    packed,
    row_invariant,
)
from ctxpar.layers.moe import MoE
from ctxpar.layers.norm import RMSNorm, norm_heads_
from ctxpar.layers.quant_linear import MappedBlocks, QuantWeight, join
from ctxpar.layers.rotary import RotaryEmbedding, apply_rotary_
from ctxpar.model_args import ModelArgs
from ctxpar.models.base import DecodeShape, FastDecodeStep
from ctxpar.models.compiled_decode import CompiledDecode, DecoderLayer, DecoderStep
from ctxpar.models.compiled_experts import DecoderExperts


def _weight(*shape: int) -> nn.Parameter:
    """An uninitialised, frozen parameter in the default dtype and device (the loader fills it)."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _optional(flag: bool, *shape: int) -> nn.Parameter | None:
    return _weight(*shape) if flag else None


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # A sliding-window layer's queries see their last sliding_window keys (Mistral v0.1, Phi-3, Qwen's
        # use_sliding_window): the kernels mask and skip by the keys' positions (layers/attention/backend.py).
        window = config.sliding_window if layer_idx in config.sliding_layers else None
        self.attn = GQA(layer_idx, self.head_dim, self.head_dim**-0.5, window)
        qkv_bias, o_bias = config.qkv_bias or config.attention_bias, config.attention_bias
        hidden = config.hidden_size
        self.qkv_weight = _weight(self.q_size + 2 * self.kv_size, hidden)  # rows: [q | k | v]
        self.qkv_bias = _optional(qkv_bias, self.q_size + 2 * self.kv_size)
        self.o_weight = _weight(hidden, self.q_size)
        self.o_bias = _optional(o_bias, hidden)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: (n, hidden), cos/sin: (n, head_dim/2) -> (n, hidden)."""
        n = x.shape[0]
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias)  # (n, (h + 2 kvh) * hd)
        qk = qkv[:, : self.q_size + self.kv_size].view(n, h + kvh, hd)  # Q and K heads side by side
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (Qwen3)
            norm_heads_(self.q_norm, qk[:, :h])
            norm_heads_(self.k_norm, qk[:, h:])
        apply_rotary_(qk, cos, sin)  # one rope pass for Q and K, in place in qkv
        q = qk[:, :h]  # (n, h, hd)
        entries = qkv[:, self.q_size :].view(n, 2, kvh, hd)  # K then V: the cache's entry layout
        out = attend(q, entries, ctx, self.attn)  # (n, h, hd); padding tokens: zeros
        return linear(out.view(n, self.q_size), self.o_weight, self.o_bias)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise CtxparError(f"unsupported hidden_act {config.hidden_act!r} (only 'silu')")
        bias = config.mlp_bias
        self.inter = config.intermediate_size
        self.gate_up_weight = _weight(2 * self.inter, config.hidden_size)  # rows: [gate | up]
        self.gate_up_bias = _optional(bias, 2 * self.inter)
        self.down_weight = _weight(config.hidden_size, self.inter)
        self.down_bias = _optional(bias, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Where each row computes alone, MLP_ROWS rows at a time (layers/linear.py): the same bits.
        if x.shape[0] <= MLP_ROWS or not (row_invariant(self.gate_up_weight) and row_invariant(self.down_weight)):
            return self._rows(x)
        return torch.cat([self._rows(x[i : i + MLP_ROWS]) for i in range(0, x.shape[0], MLP_ROWS)])

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)  # (n, 2I)
        return linear(silu_and_mul(gate_up), self.down_weight, self.down_bias)  # (n, hidden)


def _dense(mlp: LlamaMLP | MoE) -> LlamaMLP:
    """A layer's MLP as a fused checkpoint names it: dense (Phi-3's; a mixture of experts has none)."""
    if not isinstance(mlp, LlamaMLP):
        raise CtxparError("fused gate_up_proj weights are a dense MLP's; this layer has experts")
    return mlp


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArgs, layer_idx: int, mlp: LlamaMLP | MoE | None = None) -> None:
        """mlp: the layer's feed-forward (default: the dense SwiGLU; Qwen-MoE's experts: models/qwen_moe.py)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: LlamaMLP | MoE = LlamaMLP(config) if mlp is None else mlp

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin, ctx)
        x = self.post_attention_layernorm(a, residual=h)  # h += a (the residual add), then its norm
        return h.add_(self.mlp(x))


class LlamaForCausalLM(nn.Module):
    """CausalLM (ctxpar/models/base.py) for Llama, Qwen2, Qwen3 and SmolLM2 configs.

    Parameters are created uninitialised in the default dtype/device; fill them
    with ``load_weights``. The rope tables stay fp32 whatever the dtype.
    """

    def __init__(self, config: ModelArgs | Any) -> None:
        """config: the model's description, or a transformers config (described: ``ModelArgs.of``)."""
        super().__init__()
        config = ModelArgs.of(config)
        self.config = config
        self.tie_word_embeddings = config.tie_word_embeddings
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_hidden_layers))
        attn = self.decoder_layers[0].self_attn
        self.kv_entry_shape: tuple[int, ...] = (2, attn.num_kv_heads, attn.head_dim)
        self.kv_scale_runs = default_runs(self.kv_entry_shape)  # one scale per K or V head
        self.num_kv_layers: int = config.num_hidden_layers
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = self.embed_tokens if self.tie_word_embeddings else _weight(config.vocab_size, config.hidden_size)
        self.lm_head_packed: Weight | None = None  # packed copy of lm_head, see pack_for_cpu
        self.rotary = RotaryEmbedding(config, attn.head_dim)

    def decoder_layer(self, config: ModelArgs, layer_idx: int) -> LlamaDecoderLayer:
        """Layer ``layer_idx``: Llama's attention and feed-forward (a subclass's may be another layout)."""
        return LlamaDecoderLayer(config, layer_idx, self.feed_forward(config, layer_idx))

    def feed_forward(self, config: ModelArgs, layer_idx: int) -> LlamaMLP | MoE:
        """Layer ``layer_idx``'s feed-forward: the dense SwiGLU (a subclass's may be experts)."""
        return LlamaMLP(config)

    @property
    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """``layers``, typed: nn.ModuleList's items are plain Modules to the type checker."""
        return cast(list[LlamaDecoderLayer], list(self.layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: (n,) int64 -> hidden states (n, hidden) after the final norm."""
        h = embedding(input_ids, self.embed_tokens, self.norm.weight.dtype)  # (n, hidden)
        cos, sin = self.rotary(positions)  # (n, hd/2) each, fp32
        for layer in self.layers:
            h = layer(h, cos, sin, ctx)
        return self.norm(h)

    def decode_step(self) -> DecoderStep:
        """This model's decode step as its fast paths run it: the same weights, norms and
        constants, in the order ``forward`` uses them (after loading and packing)."""
        attn = self.decoder_layers[0].self_attn
        shape = DecodeShape(
            hidden=self.config.hidden_size,
            intermediate=self.config.intermediate_size,  # the dense MLPs' (a layer of experts sizes its own)
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            act_bytes=self.norm.weight.element_size(),
        )
        layers = [
            DecoderLayer(
                input_norm=layer.input_layernorm.weight,
                qkv=(layer.self_attn.qkv_weight, layer.self_attn.qkv_bias),
                o=(layer.self_attn.o_weight, layer.self_attn.o_bias),
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=None if isinstance(layer.mlp, MoE) else (layer.mlp.gate_up_weight, layer.mlp.gate_up_bias),
                down=None if isinstance(layer.mlp, MoE) else (layer.mlp.down_weight, layer.mlp.down_bias),
                experts=DecoderExperts.of(layer.mlp) if isinstance(layer.mlp, MoE) else None,
                window=layer.self_attn.attn.window,
                q_norm=None if layer.self_attn.q_norm is None else layer.self_attn.q_norm.weight,
                k_norm=None if layer.self_attn.k_norm is None else layer.self_attn.k_norm.weight,
            )
            for layer in self.decoder_layers
        ]
        return DecoderStep(
            shape=shape,
            eps=self.decoder_layers[0].input_layernorm.eps,
            spec=attn.attn.spec,
            turns_quantized_heads=attn.attn.turns_quantized_heads,
            embed=self.embed_tokens,
            norm=self.norm,
            rotary=self.rotary,
            layers=layers,
        )

    def fast_decode(self) -> FastDecodeStep | None:
        """``CausalLM.fast_decode``: both fast paths from ``decode_step`` (a subclass's: None
        where it has none)."""
        step = self.decode_step()
        return FastDecodeStep(step.shape, partial(CompiledDecode.build, step))

    def compute_logits(self, hidden: torch.Tensor, weight: Weight | None = None) -> torch.Tensor:
        """(m, hidden) -> (m, vocab) float32 (of weight's rows, a range of the vocabulary, if given)."""
        return linear(hidden, weight if weight is not None else self.logits_weight()).float()

    def logits_weight(self) -> Weight:
        return self.lm_head if self.lm_head_packed is None else self.lm_head_packed

    def pack_for_cpu(self) -> None:
        """After loading: pack the projection weights (CPU, fp32 or native bf16; see layers/linear.py).

        The lm_head too: unpacked, it is a plain matmul over the largest weight
        (vocab x hidden) that runs ~2x slower at decode and ~4x at batch 16.
        It is packed as a copy (113 MB more for SmolLM2): tied embeddings still
        need the plain rows for the lookup, and ``lm_head`` stays the plain
        parameter that was loaded. Quantized weights (QuantWeight) are in their
        kernel's layout already and stay as they are.
        """
        if not can_pack(self.norm.weight):
            return
        if isinstance(self.lm_head, torch.Tensor):
            self.lm_head_packed = packed(self.lm_head)
        for layer in self.decoder_layers:
            for name in ("qkv_weight", "o_weight"):
                pack_weight(layer.self_attn, name)
            if isinstance(layer.mlp, MoE):  # each expert's projections, and the router's
                pack_linears(layer.mlp)
                pack_weight(layer.mlp.gate, "weight")
                continue
            for name in ("gate_up_weight", "down_weight"):
                pack_weight(layer.mlp, name)

    def _targets(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        """HF tensor name -> (parameter, first row, row count) inside our (possibly fused) parameters."""
        t: dict[str, tuple[nn.Parameter, int, int]] = {}

        def add(name: str, p: nn.Parameter | None, start: int = 0, rows: int | None = None) -> None:
            if p is not None:
                t[name] = (p, start, p.shape[0] if rows is None else rows)

        add("model.embed_tokens.weight", self.embed_tokens)
        add("model.norm.weight", self.norm.weight)
        if not self.tie_word_embeddings:
            add("lm_head.weight", self.lm_head)
        for i, layer in enumerate(self.decoder_layers):
            pre, a, m = f"model.layers.{i}.", layer.self_attn, layer.mlp
            add(pre + "input_layernorm.weight", layer.input_layernorm.weight)
            add(pre + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
            fused = self.config.model_type == "phi3"  # Phi-3's checkpoints fuse Q|K|V and gate|up, as ctxpar does
            if fused:
                add(pre + "self_attn.qkv_proj.weight", a.qkv_weight)
                add(pre + "mlp.gate_up_proj.weight", _dense(m).gate_up_weight)
            for kind, p in () if fused else (("weight", a.qkv_weight), ("bias", a.qkv_bias)):
                add(pre + f"self_attn.q_proj.{kind}", p, 0, a.q_size)
                add(pre + f"self_attn.k_proj.{kind}", p, a.q_size, a.kv_size)
                add(pre + f"self_attn.v_proj.{kind}", p, a.q_size + a.kv_size, a.kv_size)
            add(pre + "self_attn.o_proj.weight", a.o_weight)
            add(pre + "self_attn.o_proj.bias", a.o_bias)
            if a.q_norm is not None and a.k_norm is not None:
                add(pre + "self_attn.q_norm.weight", a.q_norm.weight)
                add(pre + "self_attn.k_norm.weight", a.k_norm.weight)
            if isinstance(m, MoE):  # its parameters carry the checkpoint's names
                for name, p in m.named_parameters():
                    add(pre + f"mlp.{name}", p)
                continue
            for kind, p in () if fused else (("weight", m.gate_up_weight), ("bias", m.gate_up_bias)):
                add(pre + f"mlp.gate_proj.{kind}", p, 0, m.inter)
                add(pre + f"mlp.up_proj.{kind}", p, m.inter, m.inter)
            add(pre + "mlp.down_proj.weight", m.down_weight)
            add(pre + "mlp.down_proj.bias", m.down_bias)
        return t

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight | MappedBlocks]]) -> None:
        """Copy Hugging Face-named tensors in; CtxparError on a missing, unexpected or mis-shaped one.

        Rotary ``inv_freq`` buffers are ignored, and so is ``lm_head.weight``
        when the embeddings are tied. A QuantWeight, or a GGUF's blocks kept
        quantized (MappedBlocks), replaces its parameter (``_place_quantized``).
        """
        if self.lm_head_packed is not None:
            raise RuntimeError("the weights are packed for CPU already; load_weights must come before pack_for_cpu()")
        targets = self._targets()
        missing = set(targets)
        unexpected: list[str] = []
        quantized: dict[int, list[tuple[int, QuantWeight | MappedBlocks]]] = {}  # id(param) -> (first row, part)
        # id(param) -> every (module, name) it goes by (tied embeddings: embed_tokens and lm_head),
        # found once: a mixture of experts has thousands of parameters to place.
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for m in self.modules():
            for n, p in m._parameters.items():
                owners.setdefault(id(p), []).append((m, n))
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            if name not in targets:
                unexpected.append(name)
                continue
            param, start, rows = targets[name]
            expected = (rows, *param.shape[1:])
            if tuple(tensor.shape) != expected:
                raise CtxparError(f"weight {name} has shape {tuple(tensor.shape)}, the model expects {expected}")
            if isinstance(tensor, (QuantWeight, MappedBlocks)):
                parts = quantized.setdefault(id(param), [])
                parts.append((start, tensor))
                if sum(w.out_features for _, w in parts) == param.shape[0]:  # whole: joined now, parts freed
                    self._place_quantized(owners[id(param)], quantized.pop(id(param)))
            else:
                param[start : start + rows].copy_(tensor)
            missing.discard(name)
        if unexpected or missing:
            raise CtxparError(
                f"checkpoint does not match the {self.config.model_type} model: "
                f"{len(missing)} missing tensor(s) {sorted(missing)[:5]}, "
                f"{len(unexpected)} unexpected tensor(s) {sorted(unexpected)[:5]}"
            )
        # Left: parameters whose rows came partly as floats. Their quantized parts are
        # dequantized into them (the float path, as exact).
        params = {id(p): p for p, _, _ in targets.values()}
        for key, parts in quantized.items():
            for start, w in parts:
                params[key][start : start + w.out_features].copy_(w.dequantize())

    def _place_quantized(
        self, owners: list[tuple[nn.Module, str]], parts: list[tuple[int, QuantWeight | MappedBlocks]]
    ) -> None:
        """A parameter whose rows all came quantized becomes one QuantWeight (the parts
        of a fused one joined, layers/quant_linear.py's ``join``), a plain attribute
        in the parameter's place under each of its ``owners`` (module, name), as soon as
        its last part arrives: the parts are freed then, not after the whole model (which
        would hold two copies of it at once)."""
        parts.sort(key=lambda part: part[0])
        joined = join([w for _, w in parts])
        for m, n in owners:  # every name the parameter goes by
            delattr(m, n)
            setattr(m, n, joined)


# Qwen2/Qwen3 are the same code; the description's qkv_bias and qk_norm (ctxpar/model_args.py) select them.
Qwen2ForCausalLM = LlamaForCausalLM
Qwen3ForCausalLM = LlamaForCausalLM
