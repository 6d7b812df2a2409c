"""Tiny random models built and saved with transformers.

The weights are random but real: transformers writes config.json and
safetensors exactly as for a hub checkpoint, so ctxpar loads them through its
normal path and the transformers forward pass is an independent reference.
"""

from __future__ import annotations

from pathlib import Path

from ctxpar.models.random_checkpoint import save_random_model

TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def save_tiny_model(config, path: Path, seed: int = 0) -> Path:
    """Instantiate a random transformers model for `config` and save it to `path`
    (matrices times 4: random init is small, and logits would be near-ties everywhere)."""
    return save_random_model(config, path, seed, scale=4.0)


def tiny_configs() -> dict:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**TINY_COMMON, tie_word_embeddings=False),
        "llama3_rope": LlamaConfig(
            **TINY_COMMON,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen2": Qwen2Config(**TINY_COMMON),
        "qwen3": Qwen3Config(**TINY_COMMON, head_dim=32),
    }


def meta_model(name: str):
    """(transformers config, ctxpar model) of a tiny config ("deepseek-v3", or one of
    ``tiny_configs``'s names), built on the meta device: its shapes, no weights."""
    import torch

    from ctxpar.models.deepseek import DeepseekV3ForCausalLM
    from ctxpar.models.llama import LlamaForCausalLM
    from helpers.deepseek_configs import tiny_deepseek_configs

    config = tiny_deepseek_configs()["v3"] if name == "deepseek-v3" else tiny_configs()[name]
    cls = DeepseekV3ForCausalLM if name == "deepseek-v3" else LlamaForCausalLM
    with torch.device("meta"):
        return config, cls(config)
