"""DeepSeek-V2 and DeepSeek-V3 GGUF files (``general.architecture`` ``deepseek2``) as llama.cpp's
converter (convert_hf_to_gguf.py's DeepseekV2Model) writes them: the description their
config.json gave (models/deepseek.py runs it), and the key and value up-projection the converter
splits in two, joined back.

What the file keeps and how it reads back:

- MLA: ``attention.kv_lora_rank``, ``attention.q_lora_rank`` (absent: the query has no low-rank
  step, V2-Lite), the rope's part of a head ``rope.dimension_count``, the whole query/key head
  ``attention.key_length_mla`` and the value head ``attention.value_length_mla`` (files before
  those keys: ``attention.key_length`` and ``value_length``). ``attention.head_count_kv`` is 1,
  llama.cpp's view of the latent as one shared head; the checkpoint's is the query heads'.
- Experts: ``expert_count``, ``expert_used_count``, ``expert_shared_count``,
  ``expert_feed_forward_length``, ``leading_dense_block_count`` (first_k_dense_replace),
  ``expert_group_count``/``expert_group_used_count``, ``expert_weights_scale``
  (routed_scaling_factor, 1 where absent), ``expert_weights_norm`` (norm_topk_prob, written only
  when true).
- V2 or V3: V3's router scores by sigmoid (``expert_gating_func`` 2) and chooses with a learned
  bias (``exp_probs_b``). The converter writes the gating function only where config.json
  names ``scoring_func``, so a file with the bias and no gating function is V3's too (llama.cpp
  would route it by softmax, as an old V2 file). V2's routing by groups (n_group > 1) is read as
  its config.json's group_limited_greedy, a group scored by its best expert, as transformers
  computes it; llama.cpp scores a group by its best two.
- Rope: adjacent pairs rotated (llama.cpp's rope for deepseek2; transformers' V2, and V3's
  ``rope_interleave``), no row permuted. Yarn: ``rope.scaling.type`` yarn, ``factor``,
  ``original_context_length``, the betas, and ``yarn_log_multiplier``, which the converter
  writes as 0.1 * mscale_all_dim; the checkpoints' ``mscale`` equals it (DeepSeek-V2's 0.707,
  V3's 1.0), and llama.cpp computes with both equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ctxpar.errors import CtxparError
from ctxpar.model_args import RopeScaling

ARCH = "deepseek2"
SOFTMAX, SIGMOID = 1, 2  # llama.cpp's expert_gating_func values (LLAMA_EXPERT_GATING_FUNC_TYPE_*)
YARN_LOG_MUL = 0.1  # the converter's yarn_log_multiplier per unit of mscale_all_dim
# The ones a float32 yarn_log_multiplier / 0.1 is rounded to: the checkpoints' few digits back.
_MSCALE_DIGITS = 6


def mla_fields(meta: dict[str, Any], names: set[str], path: Path) -> tuple[tuple[str, str, int], dict[str, Any]]:
    """A ``deepseek2`` file's (model_type, Hugging Face architecture, head_dim: the rope's part of a
    head) and ModelArgs' fields beyond the Llama family's: MLA's dimensions, the experts and the
    V2 or V3 router, every one stated (its config.json is read back by transformers' class, whose
    defaults are DeepSeek-V2's and V3's full-size model's)."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{ARCH}.{name}", default)
        if value is None:
            raise CtxparError(f"GGUF file {path} lacks metadata {ARCH}.{name}")
        return value

    rope_dim, kv_rank = key("rope.dimension_count"), key("attention.kv_lora_rank")
    qk_dim = meta.get(f"{ARCH}.attention.key_length_mla") or key("attention.key_length")
    v_dim = meta.get(f"{ARCH}.attention.value_length_mla") or key("attention.value_length")
    biased = any(n.endswith(".exp_probs_b.bias") for n in names)
    gating = meta.get(f"{ARCH}.expert_gating_func")
    if gating not in (None, SOFTMAX, SIGMOID) or (gating == SOFTMAX and biased):
        raise CtxparError(
            f"GGUF file {path} routes its experts by expert_gating_func {gating}"
            f"{' with a bias (exp_probs_b)' if biased else ''}; ctxpar runs DeepSeek-V2's softmax "
            "router (1, no bias) and V3's sigmoid router (2, with exp_probs_b)"
        )
    v3 = gating == SIGMOID or biased
    groups = meta.get(f"{ARCH}.expert_group_count") or 1
    method = "noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy"
    kind = ("deepseek_v3", "DeepseekV3ForCausalLM") if v3 else ("deepseek_v2", "DeepseekV2ForCausalLM")
    return (*kind, rope_dim), dict(
        q_lora_rank=meta.get(f"{ARCH}.attention.q_lora_rank") or None,
        kv_lora_rank=kv_rank,
        qk_nope_head_dim=qk_dim - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v_dim,
        rope_interleave=True,
        num_nextn_predict_layers=0,  # the converter leaves the MTP layers out
        n_routed_experts=key("expert_count"),
        n_shared_experts=key("expert_shared_count"),
        moe_intermediate_size=key("expert_feed_forward_length"),
        num_experts_per_tok=key("expert_used_count"),
        first_k_dense_replace=key("leading_dense_block_count", 0),
        moe_layer_freq=1,
        n_group=groups,
        topk_group=meta.get(f"{ARCH}.expert_group_used_count") or groups,
        topk_method=method,
        scoring_func="sigmoid" if v3 else "softmax",
        norm_topk_prob=bool(meta.get(f"{ARCH}.expert_weights_norm", False)),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
    )


def yarn_rope(meta: dict[str, Any], theta: float) -> RopeScaling:
    """A ``deepseek2`` file's yarn rope as its config.json's rope_parameters stated it."""
    mscale = round(float(meta.get(f"{ARCH}.rope.scaling.yarn_log_multiplier", 0.0)) / YARN_LOG_MUL, _MSCALE_DIGITS)
    beta_fast = meta.get(f"{ARCH}.rope.scaling.yarn_beta_fast")
    beta_slow = meta.get(f"{ARCH}.rope.scaling.yarn_beta_slow")
    return RopeScaling(
        rope_type="yarn",
        rope_theta=theta,
        factor=float(meta[f"{ARCH}.rope.scaling.factor"]),
        original_max_position_embeddings=int(meta[f"{ARCH}.rope.scaling.original_context_length"]),
        beta_fast=None if beta_fast is None else float(beta_fast),
        beta_slow=None if beta_slow is None else float(beta_slow),
        mscale=mscale or None,
        mscale_all_dim=mscale or None,
    )


def joined_kv_b(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``weights`` with each layer's ``self_attn.k_b_proj`` (heads, kv_lora_rank, nope: the
    converter's transpose) and ``self_attn.v_b_proj`` (heads, v, kv_lora_rank), which it writes
    one after the other, joined into the checkpoint's ``kv_b_proj`` (heads * (nope + v),
    kv_lora_rank): each head's key rows, then its value rows."""
    k_b: dict[str, torch.Tensor] = {}
    for name, w in weights:
        if name.endswith(".self_attn.k_b_proj.weight"):
            k_b[name.removesuffix("k_b_proj.weight")] = w
            continue
        if name.endswith(".self_attn.v_b_proj.weight"):
            prefix = name.removesuffix("v_b_proj.weight")
            if prefix not in k_b:
                raise CtxparError(f"GGUF tensor of {name} comes without its key half (attn_k_b) before it")
            keys = k_b.pop(prefix).transpose(1, 2)  # (heads, nope, kv_lora_rank)
            yield f"{prefix}kv_b_proj.weight", torch.cat([keys, w], dim=1).flatten(0, 1).contiguous()
            continue
        yield name, w
    if k_b:
        raise CtxparError(f"GGUF tensors {', '.join(sorted(k_b))}attn_k_b come without their value half (attn_v_b)")
