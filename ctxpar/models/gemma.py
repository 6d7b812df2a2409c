"""Gemma 2 and Gemma 3 (text: ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``): the Llama model's
projections, fused and packed as Llama's (ctxpar/models/llama.py), in Gemma's decoder layer.

As transformers computes them (models/gemma2, models/gemma3):

- the embeddings times sqrt(hidden_size), that factor rounded to the activations' dtype first;
- a norm on each side of the attention and of the MLP ("sandwich" norms), each an RMSNorm
  whose factor is 1 + w, computed in float32 when loading (layers/norm.py's ``unit_offset``):
  a checkpoint's (and transformers' GGUF reader's) w, a GGUF file's 1 + w less 1 (models/gguf.py);
- the attention scaled by query_pre_attn_scalar**-0.5 (head_dim independent of the width),
  its logits soft-capped (Gemma 2: cap * tanh(logit / cap), cap 50) and, in the sliding
  layers (``layer_types``: Gemma 2 every other one, Gemma 3 five in six), windowed to the
  last ``sliding_window`` keys; each layer's variant is its ``AttentionSpec``, computed in
  the attention kernels (ctxpar/layers/attention/backend.py);
- Gemma 3: per-head q/k norms before rope (Llama's, Qwen3's), and its sliding layers' own
  rope (base 10000, unscaled) beside the global layers' (base 1e6, maybe linear scaling);
- the MLP's activation gelu_tanh(gate) * up (layers/activation.py);
- the final logits soft-capped (Gemma 2: 30).

Its decode step is Llama's (``decode_step``) with the sandwich norms, the sliding layers'
rope, the embeddings' factor and the GELU-tanh marked in: the compiled loop
(ctxpar/models/compiled_decode.py) runs it as it runs Llama's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from ctxpar.errors import CtxparError
from ctxpar.layers.activation import gelu_tanh_and_mul
from ctxpar.layers.attention.attend import GQA
from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.linear import Weight, embedding, linear
from ctxpar.layers.norm import RMSNorm, unit_offset
from ctxpar.layers.quant_linear import MappedBlocks, QuantWeight
from ctxpar.layers.rotary import RotaryEmbedding
from ctxpar.model_args import ModelArgs
from ctxpar.models.compiled_decode import DecoderStep
from ctxpar.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

# transformers' names of the tanh approximation of GELU, which Gemma's configs name.
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
_EXTRA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaMLP(LlamaMLP):
    """Llama's MLP (gate and up fused in one matmul, then down) with gelu_tanh(gate) * up."""

    def __init__(self, config: ModelArgs) -> None:
        if config.hidden_act not in GELU_TANH:
            raise CtxparError(f"unsupported hidden_activation {config.hidden_act!r} for Gemma (only {GELU_TANH})")
        super().__init__(dataclasses.replace(config, hidden_act="silu"))  # Llama's weights; _rows is Gemma's

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)  # (n, 2I)
        return linear(gelu_tanh_and_mul(gate_up), self.down_weight, self.down_bias)  # (n, hidden)


class GemmaDecoderLayer(LlamaDecoderLayer):
    """h += post_attention_norm(attn(input_norm(h))); h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))."""

    def __init__(self, config: ModelArgs, layer_idx: int) -> None:
        super().__init__(config, layer_idx, GemmaMLP(config))
        attn = self.self_attn
        window = config.sliding_window if layer_idx in config.sliding_layers else None
        scale = (config.query_pre_attn_scalar or attn.head_dim) ** -0.5
        attn.attn = GQA(layer_idx, attn.head_dim, scale, window, config.attn_logit_softcapping)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin, ctx)
        x = self.pre_feedforward_layernorm(self.post_attention_layernorm(a), residual=h)  # h += normed a; its norm
        return h.add_(self.post_feedforward_layernorm(self.mlp(x)))


class GemmaForCausalLM(LlamaForCausalLM):
    """CausalLM (ctxpar/models/base.py) for Gemma 2 and Gemma 3 text configs; Llama's weight
    placement, packing and loading (HF names; the norms' factors 1 + w). Gemma 3 4B-27B's
    checkpoints (``Gemma3ForConditionalGeneration``) hold its text model beside a vision tower:
    their text weights are read under the text model's names, the vision ones not read at all
    (``checkpoint_prefixes``; ctxpar runs text)."""

    # A checkpoint name's prefix -> this model's (None: not read). Gemma 3's multimodal checkpoints
    # as the hub has them (language_model.model.*) and as transformers 5 holds them in memory.
    checkpoint_prefixes: dict[str, str | None] = {
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
        "model.language_model.": "model.",
        "vision_tower.": None,
        "multi_modal_projector.": None,
        "model.vision_tower.": None,
        "model.multi_modal_projector.": None,
    }

    def __init__(self, config: ModelArgs | Any) -> None:
        """config: the model's description, or a transformers config (described: ``ModelArgs.of``)."""
        super().__init__(config)  # its rotary: the global layers' (every layer's in Gemma 2)
        config = self.config
        self.layer_kinds = config.layer_types or ("full_attention",) * config.num_hidden_layers
        attn = self.decoder_layers[0].self_attn
        local = config.sliding_rope
        self.sliding_rotary = (
            None if local is None else RotaryEmbedding(dataclasses.replace(config, rope=local), attn.head_dim)
        )
        # sqrt(hidden) as transformers holds it (a float32 tensor), rounded to the activations' dtype when used.
        self.embed_scale: torch.Tensor
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size**0.5, dtype=torch.float32), persistent=False
        )

    def decoder_layer(self, config: ModelArgs, layer_idx: int) -> GemmaDecoderLayer:
        return GemmaDecoderLayer(config, layer_idx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: (n,) int64 -> hidden states (n, hidden) after the final norm."""
        h = embedding(input_ids, self.embed_tokens, self.norm.weight.dtype)  # (n, hidden)
        h.mul_(self.embed_scale.to(h.dtype))
        ropes = {"full_attention": self.rotary(positions)}  # (n, hd/2) cos and sin, fp32
        ropes["sliding_attention"] = (
            ropes["full_attention"] if self.sliding_rotary is None else self.sliding_rotary(positions)
        )
        for layer, kind in zip(self.layers, self.layer_kinds):
            h = layer(h, *ropes[kind], ctx)
        return self.norm(h)

    def decode_step(self) -> DecoderStep:
        """Llama's decode step (the same weights, in ``forward``'s order) with Gemma's layer:
        the attention's output normed before the residual add, the pre-feedforward norm as the
        MLP's input norm, the MLP's output normed; the sliding layers' own rope; GELU-tanh."""
        step = super().decode_step()
        local = self.sliding_rotary is not None
        layers = [
            dataclasses.replace(
                d,
                post_norm=layer.pre_feedforward_layernorm.weight,
                attn_out_norm=layer.post_attention_layernorm.weight,
                mlp_out_norm=layer.post_feedforward_layernorm.weight,
                local_rope=local and kind == "sliding_attention",
            )
            for d, layer, kind in zip(step.layers, self.gemma_layers, self.layer_kinds)
        ]
        return dataclasses.replace(
            step, layers=layers, local_rotary=self.sliding_rotary, gelu=True, embed_scale=self.embed_scale
        )

    @property
    def gemma_layers(self) -> list[GemmaDecoderLayer]:
        """``layers``, typed as Gemma's."""
        return cast(list[GemmaDecoderLayer], list(self.layers))

    def compute_logits(self, hidden: torch.Tensor, weight: Weight | None = None) -> torch.Tensor:
        """Llama's logits, soft-capped where the model caps them (cap * tanh(logit / cap))."""
        logits = super().compute_logits(hidden, weight)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def _targets(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        targets = super()._targets()
        for i, layer in enumerate(self.decoder_layers):
            for name in _EXTRA_NORMS:
                p = getattr(layer, name).weight
                targets[f"model.layers.{i}.{name}.weight"] = (p, 0, p.shape[0])
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight | MappedBlocks]]) -> None:
        """Llama's, each norm's weight w placed as its factor 1 + w."""
        super().load_weights(
            (name, unit_offset(w) if name.endswith("norm.weight") and isinstance(w, torch.Tensor) else w)
            for name, w in weights
        )


Gemma2ForCausalLM = GemmaForCausalLM
Gemma3ForCausalLM = GemmaForCausalLM
