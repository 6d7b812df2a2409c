"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention + mixture of experts.

Module and parameter names mirror the Hugging Face checkpoints
(``model.layers.{i}.self_attn.kv_b_proj.weight``, ``...mlp.experts.{e}.gate_proj.weight``,
...), so loading is a name-for-name copy. The per-token KV-cache entry of a
layer is the MLA latent: ``(kv_lora_rank + qk_rope_head_dim,)`` values.

Differences between the two, as transformers implements them:

- rope: V2 rotates adjacent pairs (2i, 2i+1) (complex-number rope); V3 does
  the same when ``rope_interleave`` (default True), else the half-split layout.
- routing: V2 softmax scores with "greedy" / "group_limited_greedy"; V3
  sigmoid scores with ``e_score_correction_bias`` ("noaux_tc").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ctxpar.errors import CtxparError
from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.linear import Linear, Weight, can_pack, linear, pack_linears, pack_weight, packed
from ctxpar.layers.mla import MLAttention
from ctxpar.layers.moe import GatedMLP, MoE, TopkRouter
from ctxpar.layers.norm import RMSNorm
from ctxpar.layers.quant_linear import MappedBlocks, QuantWeight, join
from ctxpar.layers.rotary import RotaryEmbedding


class DeepseekLayerBody(nn.Module):
    """A decoder layer's attention and MLP with their norms, under the checkpoint's names. The
    model's layers and the MTP layer (deepseek_mtp.py), whose input differs, each add a forward."""

    def __init__(self, config, layer_idx: int, variant: str, cache_idx: int | None = None) -> None:
        """cache_idx: which of the KV caches the layer uses (default: layer_idx)."""
        super().__init__()
        rope_interleaved = True if variant == "v2" else bool(getattr(config, "rope_interleave", True))
        self.self_attn = MLAttention(config, layer_idx if cache_idx is None else cache_idx, rope_interleaved)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp: MoE | GatedMLP
        if is_moe_layer(config, layer_idx):
            self.mlp = MoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.n_routed_experts,
                config.n_shared_experts or 0,
                make_router(config, variant),
                config.hidden_act,
                shared_bias=mlp_bias,
            )
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=mlp_bias)

    def body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekDecoderLayer(DeepseekLayerBody):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.body(x, cos, sin, ctx)


def is_moe_layer(config, layer_idx: int) -> bool:
    """DeepSeek's rule: MoE from layer first_k_dense_replace on, every moe_layer_freq-th layer."""
    if not getattr(config, "n_routed_experts", None):
        return False
    freq = getattr(config, "moe_layer_freq", 1) or 1
    return layer_idx >= (config.first_k_dense_replace or 0) and layer_idx % freq == 0


def make_router(config, variant: str) -> TopkRouter:
    if variant == "v3":
        method = getattr(config, "topk_method", None) or "noaux_tc"
        scoring = getattr(config, "scoring_func", None) or "sigmoid"
        if method != "noaux_tc" or scoring != "sigmoid":
            raise CtxparError(
                f"DeepseekV3 supports topk_method='noaux_tc' with scoring_func='sigmoid', got {method!r}/{scoring!r}"
            )
    else:
        method = getattr(config, "topk_method", None) or "greedy"
        scoring = getattr(config, "scoring_func", None) or "softmax"
        if method not in ("greedy", "group_limited_greedy") or scoring != "softmax":
            raise CtxparError(
                f"DeepseekV2 supports topk_method 'greedy'/'group_limited_greedy' with scoring_func='softmax', "
                f"got {method!r}/{scoring!r}"
            )
    return TopkRouter(
        config.hidden_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
        method,
        config.n_group,
        config.topk_group,
        bool(getattr(config, "norm_topk_prob", False)),
        getattr(config, "routed_scaling_factor", 1.0) or 1.0,
    )


class _DeepseekInner(nn.Module):
    """The ``model.`` prefix of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config, variant: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i, variant) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class _DeepseekForCausalLM(nn.Module):
    variant = "v2"

    def __init__(self, config, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> None:
        """Parameters are uninitialised, in `dtype`/`device` (default: torch's current
        defaults, as the loader sets them); fill them with ``load_weights``. The
        router weights and bias stay float32, like transformers keeps them."""
        super().__init__()
        self.config = config
        dtype = dtype or torch.get_default_dtype()
        device = torch.device(device) if device is not None else torch.get_default_device()
        with torch.device("meta"):
            self.model = _DeepseekInner(config, self.variant)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to_empty(device=device)
        for name, p in self.named_parameters():
            p.requires_grad_(False)
            if not name.endswith(("gate.weight", "gate.e_score_correction_bias")):
                p.data = p.data.to(dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim).to(device)
        self.kv_entry_shape = (config.kv_lora_rank + config.qk_rope_head_dim,)
        self.kv_scale_runs = (config.kv_lora_rank, config.qk_rope_head_dim)
        self.num_kv_layers = config.num_hidden_layers
        self.lm_head_packed: Weight | None = None  # see pack_for_cpu

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, weight: Weight | None = None) -> torch.Tensor:
        return linear(hidden, weight if weight is not None else self.logits_weight()).float()

    def logits_weight(self) -> Weight:
        return self.lm_head.weight if self.lm_head_packed is None else self.lm_head_packed

    def pack_for_cpu(self) -> None:
        """After loading: the projections packed (``pack_projections``), and the lm_head
        through a packed copy, as for Llama (an unpacked vocab x hidden matmul is ~2x
        slower per decode step)."""
        pack_projections(self.model)
        if can_pack(self.lm_head.weight):
            self.lm_head_packed = packed(self.lm_head.weight)

    # -- loading ---------------------------------------------------------------
    def _ignored(self, name: str) -> bool:
        if name.endswith("rotary_emb.inv_freq"):
            return True
        if self.tie_word_embeddings and name == "lm_head.weight":
            return True
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None:
            return False
        # DeepSeek-V3 checkpoints append multi-token-prediction layers after the
        # last decoder layer (model.layers.61.* for V3); plain decoding ignores them.
        n_mtp = getattr(self.config, "num_nextn_predict_layers", 0) or 0
        return self.config.num_hidden_layers <= int(m.group(1)) < self.config.num_hidden_layers + n_mtp

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight | MappedBlocks]]) -> None:
        """The checkpoint's tensors (``load_named``); a quantized one (a GGUF's blocks kept, or
        int8 at load) in place of its projection's weight (``_place_quantized``)."""
        load_named(self, ((n, t) for n, t in weights if not self._ignored(n)), self._place_quantized)

    def _place_quantized(self, name: str, weight: QuantWeight | MappedBlocks) -> bool:
        """``weight`` as the weight of projection ``name`` (``linear`` computes with it where it
        lies, as the Llama model's are): an expert's, a dense MLP's, attention's but kv_b_proj (whose
        per-head halves MLAttention.pack takes as floats). False for another (the embeddings, the
        lm_head, kv_b_proj: dequantized into their parameters)."""
        owner = self.get_submodule(name.removesuffix(".weight"))
        if not isinstance(owner, Linear) or name.endswith("kv_b_proj.weight"):
            return False
        delattr(owner, "weight")
        setattr(owner, "weight", join([weight]))
        return True


def pack_projections(module: nn.Module) -> None:
    """Every projection of ``module``'s layers packed for ctxpar's panel kernel: attention's
    (and its per-head up-projections), the experts', the router's. A token's result then
    does not depend on the tokens beside it, nor on how many tokens an expert gets."""
    for m in module.modules():
        if isinstance(m, MLAttention):
            m.pack()
        elif isinstance(m, TopkRouter):
            pack_weight(m, "weight")
    pack_linears(module)


def split_fused(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """transformers' in-memory fused expert tensors -> per-expert checkpoint names."""
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
    if not m or tensor.dim() != 3:
        return [(name, tensor)]
    prefix, kind = m.groups()
    out = []
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            out += [(f"{prefix}.{e}.gate_proj.weight", gate), (f"{prefix}.{e}.up_proj.weight", up)]
        else:
            out.append((f"{prefix}.{e}.down_proj.weight", tensor[e]))
    return out


@torch.no_grad()
def load_named(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | QuantWeight | MappedBlocks]],
    place: Callable[[str, QuantWeight | MappedBlocks], bool] | None = None,
) -> None:
    """Copy checkpoint tensors into ``module``'s parameters of the same names (a quantized one
    placed by ``place`` where it takes it, else dequantized); raises CtxparError naming every
    missing or unexpected weight and any shape mismatch."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        for name, t in split_fused(hf_name, tensor) if isinstance(tensor, torch.Tensor) else [(hf_name, tensor)]:
            p = params.get(name)
            if p is None:
                unexpected.append(name)
                continue
            if tuple(t.shape) != tuple(p.shape):
                raise CtxparError(
                    f"{type(module).__name__}: weight {name} has shape {tuple(t.shape)}, "
                    f"the config implies {tuple(p.shape)}"
                )
            if isinstance(t, torch.Tensor):
                p.copy_(t.to(p.dtype))
            elif place is None or not place(name, t):
                p.copy_(t.dequantize().to(p.dtype))
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if unexpected or missing:
        msg = [f"{type(module).__name__}: checkpoint does not match the config."]
        if missing:
            msg.append(
                f"missing {len(missing)} weight(s): {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")
            )
        if unexpected:
            msg.append(
                f"unexpected {len(unexpected)} weight(s): {', '.join(unexpected[:8])}"
                + (" ..." if len(unexpected) > 8 else "")
            )
            if any(n.endswith("weight_scale_inv") for n in unexpected):
                msg.append("(FP8 block-quantised checkpoints must be dequantised to bf16/fp32 first)")
        raise CtxparError(" ".join(msg))


class DeepseekV2ForCausalLM(_DeepseekForCausalLM):
    """DeepSeek-V2 / V2-Lite / V2.5 / Coder-V2 (``DeepseekV2ForCausalLM`` in config.json)."""

    variant = "v2"


class DeepseekV3ForCausalLM(_DeepseekForCausalLM):
    """DeepSeek-V3 / R1 and V3-architecture models (``DeepseekV3ForCausalLM`` in config.json)."""

    variant = "v3"
