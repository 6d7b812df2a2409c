"""What both parts of ``ctxpar bench cuda`` share: the random models and the
weights handed to ctxpar's loader, and running a part so that its failure is
reported, not fatal."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def correctness_configs(layers: int) -> dict[str, Any]:
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config

    none: dict[str, Any] = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return {
        # SmolLM2-135M's shapes (9 query / 3 KV heads of 64, tied embeddings), fewer layers.
        "smollm2": LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=layers,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            **none,
        ),
        # Qwen3's per-head q/k norms and head_dim 128 != hidden / heads.
        "qwen3": Qwen3Config(
            vocab_size=32768,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=max(2, layers // 2),
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            **none,
        ),
        # DeepSeek-V3: MLA (latent KV) and MoE, interleaved rope; float32 only (bf16 flips routing).
        "deepseek-v3": DeepseekV3Config(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=64,
            num_hidden_layers=max(2, layers // 2),
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=96,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            **none,
        ),
    }


def transformers_greedy(model, prompt: list[int], max_new_tokens: int, device=None) -> tuple[list[int], Any]:
    """The reference: transformers' greedy ``generate`` of ``model``, never stopping
    early. Returns the generated ids and the float32 logits (max_new_tokens, vocab)
    each was chosen from, so callers can tell real mismatches from near-ties."""
    import torch

    x = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


@contextlib.contextmanager
def weights_from(state: dict[str, Any]) -> Iterator[None]:
    """ctxpar's loader reads ``state`` (HF names -> tensors, on the device already) instead of
    the checkpoint directory's *.safetensors: a 16 GB model need not be written and read back."""
    from ctxpar.models import loader

    def files(d: Path, shown: Path) -> list[Path]:
        return [Path(d) / "model.safetensors"]  # never opened

    def tensors(files: list[Path], keep: Any = lambda name: True) -> Iterator[tuple[str, Any]]:
        return ((k, v) for k, v in state.items() if keep(k))

    saved = loader._safetensors_files, loader._iter_safetensors
    loader._safetensors_files, loader._iter_safetensors = files, tensors
    try:
        yield
    finally:
        loader._safetensors_files, loader._iter_safetensors = saved


def guarded(failures: dict[str, str], key: str, fn: Callable[[], Any]) -> Any:
    """fn(), or None with its traceback printed and kept under ``key``: one broken case
    must not cost the figures of the others (a GPU's time is scarce)."""
    try:
        return fn()
    except Exception:
        failures[key] = traceback.format_exc()
        print(f"{key}: FAILED\n{failures[key]}", flush=True)
        return None
