"""The paged KV cache allocated: how many blocks a rank's budget and memory hold
(one max-length request must fit), and its tensors: one flat (num_slots,
*kv_entry_shape) tensor per layer (a quantized cache: (num_slots, row_bytes) uint8
rows, ctxpar/layers/kv_quant.py).

A slot is ``block_id * block_size + offset`` (ctxpar/layers/step_description.py).
The cache knows only bytes per token per layer, so GQA layers (K and V per KV
head) and MLA layers (latent + rope key) share this code.
"""

from __future__ import annotations

import logging

import torch

from ctxpar.checks import machine_memory_bytes
from ctxpar.errors import CtxparError
from ctxpar.kernels.huge_pages import huge_zeros
from ctxpar.layers.kv_quant import KVQuant

log = logging.getLogger(__name__)


def device_memory_bytes(device: torch.device) -> int:
    """All the memory of the device the cache would live on (a GPU's, else the machine's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return machine_memory_bytes()


def num_kv_blocks(
    num_kv_blocks: int | None,
    kv_cache_bytes: int,
    block_size: int,
    bytes_per_token_per_layer: int,
    num_layers: int,
    max_model_len: int,
    device: torch.device,
    dcp_size: int = 1,
    stated: bool = True,
) -> int:
    """Blocks per rank that fit the budget; an error if one max-length request
    would not fit, or if the cache would not fit in the device's memory. Where
    max_model_len is the model's own (not ``stated`` by the user), a cache that
    holds fewer tokens bounds the requests instead, with a warning.

    Under DCP each rank stores block_size tokens of every logical block of
    block_size * dcp_size tokens: the budget per rank is unchanged and the
    cache holds dcp_size times the tokens.

    Runs before the block manager or the cache tensors exist, so an absurd size
    is refused at once instead of after (or while) allocating it.
    """
    per_block = block_size * num_layers * bytes_per_token_per_layer
    memory = device_memory_bytes(device)
    if num_kv_blocks is None and kv_cache_bytes > memory:
        raise CtxparError(
            f"kv_cache_bytes={kv_cache_bytes} ({kv_cache_bytes / 2**30:.1f} GiB per rank) exceeds the "
            f"{memory / 2**30:.1f} GiB of memory of {device.type}; lower kv_cache_bytes"
        )
    blocks = num_kv_blocks if num_kv_blocks is not None else kv_cache_bytes // per_block
    if num_kv_blocks is not None and blocks * per_block > memory:
        raise CtxparError(
            f"num_kv_blocks={blocks} needs {blocks * per_block / 2**30:.1f} GiB per rank ({per_block} bytes per "
            f"block of {block_size} tokens), more than the {memory / 2**30:.1f} GiB of memory of {device.type}; "
            f"at most {memory // per_block} blocks fit: lower num_kv_blocks"
        )
    logical = block_size * dcp_size
    needed = -(-max_model_len // logical)
    if blocks < needed and not stated and blocks > 0:
        # The model's own context (Llama 3.2's 131072) over the default budget: run with the
        # context the cache holds, as llama.cpp runs with its n_ctx, rather than refuse a
        # file that works; the engine's max_model_len is the smaller (engine.py).
        log.warning(
            "the model's context of %d tokens needs %.2f GiB of KV cache per rank; kv_cache_bytes holds %d "
            "tokens, so requests are limited to %d (raise --kv-cache-bytes, or state --max-model-len)",
            max_model_len,
            needed * per_block / 2**30,
            blocks * logical,
            blocks * logical,
        )
        return int(blocks)
    if blocks < needed:
        sharded = f", each sharded over {dcp_size} ranks" if dcp_size > 1 else ""
        bytes_needed = needed * per_block
        without_dcp = f" ({bytes_needed * dcp_size / 2**30:.2f} GiB without DCP)" if dcp_size > 1 else ""
        raise CtxparError(
            f"the KV cache holds {blocks} blocks ({blocks * logical} tokens), fewer than one request of "
            f"max_model_len={max_model_len} needs ({needed} blocks of {logical} tokens{sharded}, "
            f"{per_block} bytes each per rank): {bytes_needed / 2**30:.2f} GiB per rank{without_dcp}; "
            f"raise kv_cache_bytes to at least {bytes_needed} (or num_kv_blocks to {needed}) or lower max_model_len"
        )
    return int(blocks)


def allocate_kv_caches(
    num_layers: int,
    num_slots: int,
    kv_entry_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    quant: KVQuant | None = None,
) -> torch.Tensor:
    """(num_layers, num_slots, *kv_entry_shape) of `dtype`, or with `quant` (num_layers, num_slots,
    row_bytes) uint8 rows, zeroed; on the CPU in huge pages (a decode step reads each row's whole
    context). One allocation: element i is layer i's cache, and a slot's entries of every layer
    move in one indexing op (a led step's broadcast)."""
    shape = (num_layers, num_slots, *kv_entry_shape) if quant is None else (num_layers, num_slots, quant.row_bytes)
    dtype = dtype if quant is None else torch.uint8
    if device.type == "cpu":
        return huge_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def tokens_per_gib(bytes_per_token: int, dcp_size: int = 1) -> int:
    """Tokens one GiB of KV cache per rank holds (bytes_per_token: every layer's entry);
    under DCP each rank stores 1/D of every token."""
    return 2**30 * dcp_size // bytes_per_token
