"""A model's shape as the cost model needs it, derived from the description the engine
builds the model from (ctxpar/model_args.py: a config.json or a GGUF file's metadata).

Only counts: parameters (dense, per expert, embeddings), layers, heads and the
bytes a token leaves in the KV cache. From them, per token and layer:

- linear FLOPs = 2 * (parameters the token multiplies): dense parameters plus
  its top-k experts' in an MoE layer;
- attention FLOPs per (query, key) pair = 2 * H_q * (d_qk + d_v): Q.K^T and P.V;
- KV-cache entries = 2 * H_kv * d_head for GQA (K and V), kv_lora_rank + d_rope
  for MLA (DeepSeek stores one compressed latent per token);
- elementwise values: what the layer's steps between its projections and its
  attention read and write, one pass each (``elementwise_values``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxpar.errors import CtxparError
from ctxpar.model_args import ModelArgs, from_config_json


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    qk_head_dim: int  # per query head, rope part included (MLA: nope + rope)
    v_head_dim: int
    kv_entries_per_token: int  # values one token stores per layer in the KV cache
    dense_params: int  # non-embedding parameters every token multiplies, all layers (shared experts, router included)
    expert_params: int  # parameters of one routed expert (0: no MoE)
    num_experts: int  # routed experts per MoE layer
    experts_per_token: int
    num_moe_layers: int
    embedding_params: int
    lm_head_params: int  # 0 when tied to the embedding
    decode_qk_dim: int  # per-head dims a decode query multiplies a cached entry with (MLA: absorbed latent)
    decode_v_dim: int
    # Runs of a token's KV entry that share one scale in a quantized cache (ctxpar/layers/kv_quant.py):
    # GQA's K and V of each KV head, MLA's latent and roped key.
    kv_scale_runs: int = 2
    # Values one token reads and writes in one layer's elementwise steps, a pass each, averaged
    # over the layers (shape_from_hf_config): its RMSNorms (the residual add before the second
    # fused in), the MLP's output joined from its row chunks, the residual add after the MLP,
    # rope in place, SiLU·up and the KV cache's write.
    # Priced at the rate `ctxpar calibrate` measures those steps of the engine at (timing.py).
    elementwise_values: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "vocab_size", "num_heads", "qk_head_dim", "v_head_dim"):
            if getattr(self, field) < 1:
                raise CtxparError(f"model {self.name}: {field} must be >= 1, got {getattr(self, field)}")
        if self.elementwise_values < 0:
            raise CtxparError(f"model {self.name}: elementwise_values must be >= 0")
        if self.kv_entries_per_token < 1 or self.dense_params < 1:
            raise CtxparError(f"model {self.name}: a model needs KV entries and dense parameters")
        if self.num_moe_layers and not (0 < self.experts_per_token <= self.num_experts and self.expert_params > 0):
            raise CtxparError(f"model {self.name}: MoE layers need 0 < experts_per_token <= num_experts")

    @property
    def total_params(self) -> int:
        return (
            self.dense_params
            + self.num_moe_layers * self.num_experts * self.expert_params
            + self.embedding_params
            + self.lm_head_params
        )

    @property
    def linear_params_per_token(self) -> int:
        """Parameters one token multiplies (its experts only), without the LM head."""
        return self.dense_params + self.num_moe_layers * self.experts_per_token * self.expert_params

    def params_read(self, tokens: float) -> float:
        """Non-embedding parameters a step of ``tokens`` tokens reads: the dense ones and
        every routed expert hit at least once. With uniform routing an expert escapes
        ``tokens`` tokens' top-k picks with probability (1 - k/E)^tokens."""
        if not self.num_moe_layers:
            return float(self.dense_params)
        hit = self.num_experts * (1.0 - (1.0 - self.experts_per_token / self.num_experts) ** tokens)
        return self.dense_params + self.num_moe_layers * hit * self.expert_params

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair in one layer, prefill form: 2*H*(d_qk + d_v)."""
        return 2 * self.num_heads * (self.qk_head_dim + self.v_head_dim)

    def kv_bytes(self, kv_cache_dtype: str, act_bytes: float) -> float:
        """Bytes one token's entry takes in one layer's KV cache: its values at
        ``act_bytes`` ("auto": a profile's own; "model": an engine's), or a quantized row: a
        byte a value, padded to 4, and a float32 scale per run (ctxpar.layers.kv_quant.KVQuant.row_bytes)."""
        if kv_cache_dtype in ("auto", "model"):
            return self.kv_entries_per_token * act_bytes
        return -(-self.kv_entries_per_token // 4) * 4 + 4 * self.kv_scale_runs

    def elementwise_bytes(self, act_bytes: float) -> float:
        """Bytes one token moves through one layer's elementwise steps (``elementwise_values``),
        its activations at ``act_bytes`` a value."""
        return self.elementwise_values * act_bytes

    @property
    def decode_attention_flops_per_pair(self) -> int:
        return 2 * self.num_heads * (self.decode_qk_dim + self.decode_v_dim)


def shape_from_hf_config(cfg: dict[str, Any], name: str) -> ModelShape:
    """ModelShape of a config.json's object (``shape_of``)."""
    try:
        args = from_config_json(cfg)
    except CtxparError as e:
        raise CtxparError(f"model config {name}: {e}") from None
    return shape_of(args, name)


def shape_of(args: ModelArgs, name: str) -> ModelShape:
    """ModelShape of a Llama/Qwen/Mistral (GQA) or DeepSeek-V2/V3 (MLA, MoE) model."""
    hidden, layers, heads, vocab = args.hidden_size, args.num_hidden_layers, args.num_attention_heads, args.vocab_size
    embedding = vocab * hidden
    lm_head = 0 if args.tie_word_embeddings else embedding
    if args.is_mla:  # DeepSeek-V2/V3
        kv_rank, nope, rope, v_dim = args.mla_dims()
        qk_dim, q_rank = nope + rope, args.q_lora_rank
        q_proj = hidden * heads * qk_dim if not q_rank else hidden * q_rank + q_rank * heads * qk_dim
        attn = q_proj + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
        kv_entries, decode_qk, decode_v, runs = kv_rank + rope, kv_rank + rope, kv_rank, 2
        # The latent's norms (q's where it has a rank), rope over the queries' and the key's rope dims.
        attn_elementwise = 2 * (kv_rank + (q_rank or 0)) + 2 * (heads + 1) * rope
    else:  # GQA (Llama, Qwen2/3, Mistral, SmolLM2)
        kv_heads, qk_dim = args.num_key_value_heads, args.head_dim
        v_dim = qk_dim
        attn = 2 * hidden * heads * qk_dim + 2 * hidden * kv_heads * qk_dim
        kv_entries, decode_qk, decode_v, runs = 2 * kv_heads * qk_dim, qk_dim, qk_dim, 2 * kv_heads
        attn_elementwise = 2 * (heads + kv_heads) * qk_dim  # rope over Q's and K's heads, in place
    inter = args.intermediate_size
    dense_mlp = 3 * hidden * inter  # gate, up, down
    experts = args.n_routed_experts or 0
    if experts:
        moe_inter = args.moe_intermediate_size or 0
        expert = 3 * hidden * moe_inter
        first_dense, freq = args.first_k_dense_replace or 0, args.moe_layer_freq or 1
        moe_layers = sum(1 for i in range(first_dense, layers) if i % freq == 0)
        shared = (args.n_shared_experts or 0) * expert + experts * hidden  # shared experts + router
        dense = layers * attn + (layers - moe_layers) * dense_mlp + moe_layers * shared
        top_k = args.num_experts_per_tok or 0
        # A token's SiLU·up: the dense MLP's width, or in an MoE layer its experts' and the shared ones'.
        moe_width = (top_k + (args.n_shared_experts or 0)) * moe_inter
        mlp_width = ((layers - moe_layers) * inter + moe_layers * moe_width) / layers
    else:
        expert, moe_layers, top_k, dense = 0, 0, 0, layers * (attn + dense_mlp)
        mlp_width = inter
    # Per token and layer: RMSNorm before attention (x read, its norm written: 2 hidden), the
    # residual add fused into the second one (a, h read; h, its norm written: 4), the MLP's
    # output joined from the row chunks ctxpar runs a long prefill's MLP in (read, written: 2),
    # the residual add after the MLP (3), SiLU·up (gate and up read, their product written:
    # 3 x the MLP's width), rope in place, and the KV cache's write (the entry read, then
    # written: 2 x entries).
    elementwise = 11 * hidden + round(3 * mlp_width) + attn_elementwise + 2 * kv_entries
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=heads,
        qk_head_dim=qk_dim,
        v_head_dim=v_dim,
        kv_entries_per_token=kv_entries,
        dense_params=dense,
        expert_params=expert,
        num_experts=experts,
        experts_per_token=top_k,
        num_moe_layers=moe_layers,
        embedding_params=embedding,
        lm_head_params=lm_head,
        decode_qk_dim=decode_qk,
        decode_v_dim=decode_v,
        kv_scale_runs=runs,
        elementwise_values=elementwise,
    )


def load_model_shape(spec: str) -> ModelShape:
    """A built-in name (``llama-3-405b``, ...), a config.json, or a model directory holding one."""
    from ctxpar.costmodel.models import BUILTIN_MODELS

    if spec in BUILTIN_MODELS:
        return shape_from_hf_config(BUILTIN_MODELS[spec], spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CtxparError(
            f"model {spec!r} is neither a built-in ({', '.join(sorted(BUILTIN_MODELS))}) "
            "nor a config.json / model directory"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CtxparError(f"cannot read model config {path}: {e}") from None
    return shape_from_hf_config(cfg, spec)
