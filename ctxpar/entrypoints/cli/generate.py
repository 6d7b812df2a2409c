"""Generate text from one prompt and stream it to the terminal.

The text goes to stdout as it is produced; a last line on stderr gives the
time to first token and the generation speed. Without --prompt or --chat,
the model is asked to write a haiku about context parallelism.

examples:
  ctxpar generate --chat "What is the capital of France?"
  ctxpar generate --prompt "Once upon a time" --max-tokens 64 --temperature 0.8 --seed 1
  ctxpar generate --model ./my-llama --pcp 2 --verbose
  ctxpar generate --pcp 2 --dcp 2 --verbose     # KV cache sharded: twice the context per rank's memory
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ctxpar.engine.arg_utils import EngineArgs
from ctxpar.knobs import add_flags, knob, knobs
from ctxpar.models.gguf_file import prefetch

if TYPE_CHECKING:
    from ctxpar.sampling_params import SamplingParams

DEFAULT_CHAT = "Write a haiku about context parallelism."
# --verbose's account of EngineConfig.weight_quantization.
WEIGHTS = {
    "gguf": "the GGUF's quantized blocks (quantization gguf)",
    "int8": "int8, quantized at load (quantization int8)",
    None: "the dtype (quantization none)",
}


@dataclass(frozen=True)
class SamplingFlags:
    """generate's sampling flags, one knob each: SamplingParams' fields under the same
    names, with a terminal's defaults (greedy, 256 tokens). Their ranges are the request's
    own, checked by SamplingParams as for every other caller (ctxpar/sampling_params.py)."""

    max_tokens: int = knob(256, "most tokens to generate", "N")
    temperature: float = knob(0.0, "0 = greedy; e.g. 0.8 to sample", "T")
    top_p: float = knob(1.0, "nucleus mass in (0, 1]; 1 = off", "P")
    top_k: int = knob(-1, "sample among the K likeliest tokens; -1 = off", "K")
    min_p: float = knob(0.0, "drop tokens below M x the top probability", "M")
    seed: int | None = knob(None, "sampling seed (default: from the engine seed)", "S")
    ignore_eos: bool = knob(False, "keep generating past the end-of-sequence token")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", metavar="TEXT", help="raw text for the model to continue")
    what.add_argument(
        "--chat",
        metavar="TEXT",
        help=f"a user message, wrapped in the model's chat template (default: {DEFAULT_CHAT!r})",
    )

    add_flags(p.add_argument_group("sampling"), SamplingFlags)
    EngineArgs.add_cli_args(p, exclude=frozenset({"seed"}))  # --seed: the request's
    p.add_argument(
        "--verbose", "-v", action="store_true", help="print the model and KV-cache layout first, prefix-cache hits last"
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The request's SamplingParams, from the sampling flags (checked there)."""
    from ctxpar import SamplingParams

    return SamplingParams(**{f.name: getattr(args, f.name) for f in knobs(SamplingFlags)})


def run(args: argparse.Namespace) -> None:
    if args.model is not None and Path(args.model).expanduser().is_file():
        # A GGUF's pages are read from the disk while torch imports (this module imports none).
        prefetch(Path(args.model).expanduser())
    from ctxpar import LLM

    params = sampling_params(args)
    t_load = time.perf_counter()
    # The load makes objects that live as long as the process: the collector's passes over
    # them are CPU time before the first token for nothing. They are frozen, out of its way.
    gc.disable()
    with LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args))) as llm:
        gc.freeze()
        gc.enable()
        if args.verbose:
            _describe(llm, time.perf_counter() - t_load)
        if args.prompt is not None:
            prompt = args.prompt
        elif args.chat is not None or getattr(llm.get_tokenizer(), "chat_template", None):
            prompt = llm.apply_chat_template([{"role": "user", "content": args.chat or DEFAULT_CHAT}])[0]
        else:
            prompt = DEFAULT_CHAT  # a model without a chat template just continues the text
        last = None
        shown = 0
        try:
            for last in llm.stream_outputs(prompt, params):
                text = last.outputs[0].text
                if len(text) > shown:
                    sys.stdout.write(text[shown:])
                    sys.stdout.flush()
                    shown = len(text)
        finally:  # end the text's line, also when a failure or Ctrl-C cuts it short
            sys.stdout.write("\n")
            sys.stdout.flush()
        if args.verbose:
            assert llm.engine is not None  # open: inside its with block
            print(prefix_cache_summary(llm.engine), file=sys.stderr)
            if llm.engine.spec is not None:
                print(spec_decode_summary(llm.engine), file=sys.stderr)
        if last is not None:
            _report(last)


def _describe(llm, load_s: float) -> None:
    from ctxpar.worker.kv_cache_allocation import tokens_per_gib

    engine = llm.engine
    model, cfg = engine.loaded.model, engine.config
    per_tok = engine.kv_bytes_per_token_per_layer
    D = cfg.dcp_size
    tokens = engine.num_blocks * cfg.block_size * D  # every logical block spreads over the D ranks
    kv_mib = engine.num_blocks * cfg.block_size * per_tok * model.num_kv_layers / 2**20
    sharding = (
        f"sharded over {D} ranks (interleave {cfg.cp_interleave}): {per_tok * model.num_kv_layers / D:g} bytes "
        f"per token per rank; {engine.num_blocks} blocks of {cfg.block_size * D} tokens ({cfg.block_size} per rank)"
        if D > 1
        else f"{per_tok * model.num_kv_layers} bytes per token; {engine.num_blocks} blocks of {cfg.block_size} tokens"
    )
    lines = [
        f"model: {engine.loaded.name} ({type(model).__name__}), {model.num_kv_layers} layers, loaded in {load_s:.1f} s",
        f"dtype: {cfg.dtype}, weights: {WEIGHTS[cfg.weight_quantization]}, context limit: {engine.max_model_len} "
        f"tokens, PCP ranks: {cfg.pcp_size}, DCP ranks: {D}",
        f"KV cache ({cfg.kv_cache_dtype}): entry {tuple(model.kv_entry_shape)} = {per_tok} bytes per token per layer, "
        f"{sharding} = {tokens} tokens in all, {kv_mib:.0f} MiB per rank, "
        f"{tokens_per_gib(per_tok * model.num_kv_layers, D)} tokens per GiB of KV per rank",
    ]
    lines += _memory_lines(engine.executor.rank_pids(), kv_mib)
    options = engine.executor.runner_options
    if options.policy is not None:
        led = " (ranks on one host lead steps without a split row)" if options.lead_threads is not None else ""
        lines.append(options.policy.describe() + led)
    print("\n".join(lines), file=sys.stderr)


def _memory_lines(pids: list[int | None], kv_mib: float) -> list[str]:
    """Each rank's resident memory by what backs it: its own copies (the weights in the
    kernels' layout, the KV cache as it fills), mapped files, the ranks' shared weights."""
    from ctxpar.machine import memory_use

    lines = []
    for rank, pid in enumerate(pids):
        use = memory_use(pid) if pid is not None else None
        if use is None:
            lines.append(f"rank {rank}: memory not readable from this host; KV cache {kv_mib:.0f} MiB")
            continue
        mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
        lines.append(
            f"rank {rank}: resident {mib(use.resident)} (own {mib(use.anonymous)}, mapped files "
            f"{mib(use.file_mapped)}, shared with the other ranks {mib(use.shared)}); KV cache {kv_mib:.0f} MiB "
            "allocated, resident as it fills"
        )
    return lines


def prefix_cache_summary(engine) -> str:
    """One line of the engine's prefix-cache counters (tokens looked up at
    admission and tokens found cached, as vLLM counts them)."""
    if not engine.config.enable_prefix_caching:
        return "prefix cache: off"
    s = engine.scheduler.prefix_cache_stats
    return (
        f"prefix cache: {s.hits} of {s.queries} queried tokens hit ({s.hit_rate:.0%}), "
        f"{engine.block_manager.num_cached_blocks} blocks cached, {engine.block_manager.num_evictions} evicted"
    )


def spec_decode_summary(engine) -> str:
    """One line of speculative decoding's counters: drafts, acceptance, tokens per verify step."""
    c, s = engine.spec.config, engine.spec.stats
    if not s.num_drafts:
        return f"speculative decoding ({c.method}, k={c.num_speculative_tokens}): no drafts"
    return (
        f"speculative decoding ({c.method}, k={c.num_speculative_tokens}): {s.num_drafts} verify steps, "
        f"{s.num_accepted_tokens} of {s.num_draft_tokens} drafted tokens accepted ({s.acceptance_rate:.0%}), "
        f"mean accepted length {s.mean_accepted_length:.2f}, accepted per position {s.accepted_per_pos}"
    )


def _report(out) -> None:
    c, m = out.outputs[0], out.metrics
    n = len(c.token_ids)
    ttft = m.ttft or 0.0
    total = (m.finished_time or time.perf_counter()) - m.arrival_time
    decode = total - ttft
    # Decode speed: tokens after the first over the time after the first, the
    # usual "eval rate"; the first token's cost is the TTFT.
    rate = (n - 1) / decode if n > 1 and decode > 0 else float("nan")
    print(
        f"[{n} tokens in {total:.2f} s | time to first token {ttft * 1000:.0f} ms | "
        f"{rate:.1f} tokens/s | {len(out.prompt_token_ids)} prompt tokens | finish: {c.finish_reason}]",
        file=sys.stderr,
    )
