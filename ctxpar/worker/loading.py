"""What every rank does first, in one place: take its threads, load the model
and size its KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxpar.config import EngineConfig
from ctxpar.device import bind_device, torch_dtype
from ctxpar.errors import CtxparError
from ctxpar.layers.kv_quant import kv_bytes_per_token_per_layer
from ctxpar.models.loader import LoadedModel, load_model, load_mtp
from ctxpar.worker.kv_cache_allocation import num_kv_blocks


@dataclass(frozen=True)
class RankModel:
    """A rank's loaded model and the size of its KV cache."""

    loaded: LoadedModel
    num_blocks: int  # KV blocks per rank (logical blocks under DCP: block_size * D tokens each)
    kv_bytes_per_token_per_layer: int
    device: torch.device
    # Speculative decoding's draft model (method "draft_model", or "mtp"'s layer): its KV cache has the
    # target's block count and size, so a request's block table serves both.
    draft: LoadedModel | None = None


def load_rank(config: EngineConfig, device: torch.device) -> RankModel:
    """Set this rank's torch threads (loading, i.e. dequantisation, uses them
    too), load the model and size the KV cache. Every rank derives the same
    sizes from the same config; an impossible size is refused here, before any
    cache tensor is allocated."""
    bind_device(device)
    threads = config.threads_per_rank()
    if threads is not None:
        torch.set_num_threads(threads)
    dtype = torch_dtype(config.dtype)
    loaded = load_model(
        config.model, dtype, device, config.max_model_len, config.hf_overrides, config.weight_quantization
    )
    model = loaded.model
    per_token = kv_bytes_per_token_per_layer(
        tuple(model.kv_entry_shape), tuple(model.kv_scale_runs), dtype, config.kv_cache_dtype
    )
    num_blocks = num_kv_blocks(
        config.num_kv_blocks,
        config.kv_cache_bytes,
        config.block_size,
        per_token,
        model.num_kv_layers,
        loaded.max_model_len,
        device,
        config.dcp_size,
        stated=config.max_model_len is not None,
    )
    draft = _load_draft(config, loaded, dtype, device)
    return RankModel(loaded, num_blocks, per_token, device, draft)


def _load_draft(
    config: EngineConfig, target: LoadedModel, dtype: torch.dtype, device: torch.device
) -> LoadedModel | None:
    """The draft model of speculative decoding, checked against the target: drafts are
    token ids, so both must have the same vocabulary. Method "mtp" drafts with the
    target checkpoint's own next-token-prediction layer."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "mtp":
        limit = spec.max_model_len or target.max_model_len
        return load_mtp(spec.model or config.model, dtype, device, limit, config.hf_overrides)
    assert spec.model is not None  # SpeculativeConfig checks it
    draft = load_model(spec.model, dtype, device, spec.max_model_len)
    vocab, draft_vocab = int(target.hf_config.vocab_size), int(draft.hf_config.vocab_size)
    if draft_vocab != vocab:
        raise CtxparError(
            f"speculative_config model {spec.model} has a vocabulary of {draft_vocab} tokens, the target model "
            f"{vocab}: a draft model must share the target's tokenizer; pick one of the same model family"
        )
    return draft
