"""Tiny random DeepSeek-V2/V3 configs (MLA + MoE), importable by any test.

    from helpers.deepseek_configs import tiny_deepseek_configs
    cfg = tiny_deepseek_configs()["v3_yarn"]

Every config has a dense first layer (first_k_dense_replace=1) followed by MoE
layers with routed and shared experts, v_head_dim != qk_head_dim (so the
head-size padding is exercised) and num_key_value_heads == num_attention_heads
(transformers' MLA requires it).
"""

from __future__ import annotations

MLA_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def tiny_deepseek_configs() -> dict:
    """{name: transformers config} covering V2/V3 routing, q_lora_rank on/off, yarn, rope layouts."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    return {
        # V2, q_proj directly, greedy softmax routing, default rope.
        "v2_greedy": DeepseekV2Config(
            **MLA_COMMON,
            num_hidden_layers=2,
            q_lora_rank=None,
            n_shared_experts=2,
            topk_method="greedy",
            routed_scaling_factor=1.5,
        ),
        # V2, low-rank query, group-limited routing, yarn rope with mscale correction.
        "v2_group_yarn": DeepseekV2Config(
            **MLA_COMMON,
            num_hidden_layers=3,
            q_lora_rank=48,
            n_shared_experts=1,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            rope_parameters=dict(YARN),
        ),
        # V3, low-rank query, noaux_tc sigmoid routing, interleaved rope.
        "v3": DeepseekV3Config(
            **MLA_COMMON,
            num_hidden_layers=2,
            q_lora_rank=48,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
        # V3, q_proj directly, yarn rope, half-split rope layout, no renormalisation.
        "v3_yarn": DeepseekV3Config(
            **MLA_COMMON,
            num_hidden_layers=3,
            q_lora_rank=None,
            n_shared_experts=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            rope_interleave=False,
            rope_parameters=dict(YARN),
        ),
    }


def save_tiny_deepseek(config, path, seed: int = 0):
    """save_tiny_model for a DeepSeek config, with V3's e_score_correction_bias
    randomised: transformers initialises it to zero, which would leave the
    bias path of noaux_tc routing untested."""
    import glob

    import torch
    from safetensors.torch import load_file, save_file

    from helpers.models import save_tiny_model

    save_tiny_model(config, path, seed=seed)
    for f in sorted(glob.glob(str(path / "*.safetensors"))):
        state = load_file(f)
        biases = [k for k in state if k.endswith("e_score_correction_bias")]
        if biases:
            g = torch.Generator().manual_seed(100 + seed)
            for k in biases:
                state[k] = torch.randn(state[k].shape, generator=g) * 0.2
            save_file(state, f, metadata={"format": "pt"})
    return path
