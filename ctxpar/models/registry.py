"""Hugging Face ``architectures[0]`` -> the ctxpar model class that serves it.

Classes are named by import path and imported on first use, so a model file
that is missing or broken only affects its own architectures. Every class
takes the HF config as its only constructor argument and implements the
CausalLM protocol (ctxpar/models/base.py).
"""

from __future__ import annotations

import importlib

from ctxpar.errors import CtxparError

ARCHITECTURES: dict[str, str] = {
    # Llama family: one implementation (ctxpar/models/llama.py).
    "LlamaForCausalLM": "ctxpar.models.llama:LlamaForCausalLM",  # incl. SmolLM2, llama3 rope
    "Qwen2ForCausalLM": "ctxpar.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "ctxpar.models.llama:Qwen3ForCausalLM",
    # MLA models (ctxpar/models/deepseek.py).
    "DeepseekV2ForCausalLM": "ctxpar.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "ctxpar.models.deepseek:DeepseekV3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def get_model_class(architecture: str) -> type:
    """The model class for an HF architecture name; CtxparError if unsupported."""
    target = ARCHITECTURES.get(architecture)
    if target is None:
        raise CtxparError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = target.split(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)


def model_class_for_config(hf_config) -> type:
    """The model class for an HF config, by its ``architectures[0]``."""
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise CtxparError(
            f'the model config names no architecture (config.json needs "architectures"); '
            f"supported: {', '.join(supported_architectures())}"
        )
    return get_model_class(archs[0])
