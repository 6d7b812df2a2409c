"""Hugging Face ``architectures[0]`` -> the ctxpar model class that serves it.

Each class is imported on first use, by a function that spells its import out (so
the import graph of tests/architecture/test_layering.py sees it): a model file that
is missing or broken only affects its own architectures. Every class takes the HF
config as its only constructor argument and implements the CausalLM protocol
(ctxpar/models/base.py).
"""

from __future__ import annotations

from collections.abc import Callable

from ctxpar.errors import CtxparError


def _llama() -> type:
    from ctxpar.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _qwen2() -> type:
    from ctxpar.models.llama import Qwen2ForCausalLM

    return Qwen2ForCausalLM


def _qwen3() -> type:
    from ctxpar.models.llama import Qwen3ForCausalLM

    return Qwen3ForCausalLM


def _qwen_moe() -> type:
    from ctxpar.models.qwen_moe import QwenMoeForCausalLM

    return QwenMoeForCausalLM


def _gemma() -> type:
    from ctxpar.models.gemma import GemmaForCausalLM

    return GemmaForCausalLM


def _deepseek_v2() -> type:
    from ctxpar.models.deepseek import DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM


def _deepseek_v3() -> type:
    from ctxpar.models.deepseek import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM


ARCHITECTURES: dict[str, Callable[[], type]] = {
    # Llama family: one implementation (ctxpar/models/llama.py).
    "LlamaForCausalLM": _llama,  # incl. SmolLM2, llama3 rope
    "MistralForCausalLM": _llama,  # Mistral v0.3 (v0.1's sliding window: refused by the model)
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Phi3ForCausalLM": _llama,  # Phi-3, 3.5, Phi-4-mini (fused QKV and gate|up; longrope; a window; partial rotary)
    # Llama's attention with a mixture of experts (ctxpar/models/qwen_moe.py).
    "Qwen2MoeForCausalLM": _qwen_moe,
    "Qwen3MoeForCausalLM": _qwen_moe,
    # Llama's projections in Gemma's decoder layer (ctxpar/models/gemma.py).
    "Gemma2ForCausalLM": _gemma,
    "Gemma3ForCausalLM": _gemma,  # Gemma 3's text models (1B; gemma3_text)
    "Gemma3ForConditionalGeneration": _gemma,  # Gemma 3 4B-27B: their text model (no vision)
    # MLA models (ctxpar/models/deepseek.py).
    "DeepseekV2ForCausalLM": _deepseek_v2,
    "DeepseekV3ForCausalLM": _deepseek_v3,
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def get_model_class(architecture: str) -> type:
    """The model class for an HF architecture name; CtxparError if unsupported."""
    load = ARCHITECTURES.get(architecture)
    if load is None:
        raise CtxparError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    return load()


def model_class_for_config(hf_config) -> type:
    """The model class for an HF config, by its ``architectures[0]``."""
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise CtxparError(
            f'the model config names no architecture (config.json needs "architectures"); '
            f"supported: {', '.join(supported_architectures())}"
        )
    return get_model_class(archs[0])
