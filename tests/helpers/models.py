"""Tiny random models built and saved with transformers.

The weights are random but real: transformers writes config.json and
safetensors exactly as for a hub checkpoint, so ctxpar loads them through its
normal path and the transformers forward pass is an independent reference.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

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
    """Instantiate a random transformers model for `config` and save it to `path`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), torch_dtype=torch.float32)
    # Random init is small; scale up so logits are not near-ties everywhere.
    # Biases (zero) and norm weights (one) are perturbed so loading them is tested too.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            else:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


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
