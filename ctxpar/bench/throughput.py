"""Offline throughput and prefill time: ctxpar versus transformers, in one run.

Workload: N prompts of seeded random lengths (64 to 1024 tokens) made of random
real token ids, each generating a fixed number of tokens greedily with EOS
ignored, so both engines do exactly the same work. Printed: output tokens/s
and mean time to first token of each, their ratios, how many requests came out
token-identical, and the time of one 2048-token prefill (one forward pass).

transformers runs each prompt alone (batch size 1, one after the other). That
is its exact, standard path: no padding tokens (with these lengths, left
padding to the longest prompt would roughly double the prefill work) and no
pad masks that change numerics. Pass --hf-batched to run it as one
left-padded batch instead, its best case for decode throughput. Both engines
see all prompts at time 0, so TTFT includes waiting for one's turn; the
"alone" figure is transformers' TTFT from the start of each request.

With --vs-pcp P0, the baseline is ctxpar itself with P0 ranks instead of
transformers: both setups share the same threads, run the same workload in
alternating rounds (--rounds), and the best run of each gives the
throughput ratio; e.g. --pcp 2 --vs-pcp 1 is what two PCP ranks on this
machine make of its cores against one rank using all of them.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from ctxpar.bench.llm_readings import first_token_seconds, model_name, vocab_size
from ctxpar.checks import int_arg, max_threads, nonnegative_int, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--model", metavar="PATH", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--num-prompts", type=positive_int, default=16, metavar="N", help="prompts in the workload (default: 16)"
    )
    p.add_argument(
        "--output-len", type=positive_int, default=64, metavar="N", help="tokens generated per prompt (default: 64)"
    )
    p.add_argument("--min-prompt-len", type=positive_int, default=64, metavar="N", help="shortest prompt (default: 64)")
    p.add_argument(
        "--max-prompt-len", type=positive_int, default=1024, metavar="N", help="longest prompt (default: 1024)"
    )
    p.add_argument(
        "--prefill-len",
        type=nonnegative_int,
        default=2048,
        metavar="N",
        help="prefill-time prompt (default: 2048, 0: skip)",
    )
    p.add_argument(
        "--threads",
        type=int_arg(1, max_threads()),
        metavar="N",
        help="torch threads for both engines (default: all cores)",
    )
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the prompt lengths and tokens (default: 0)")
    p.add_argument(
        "--pcp",
        type=int_arg(1, max_threads()),
        default=1,
        metavar="P",
        help="ctxpar's PCP ranks, each with threads / P torch threads (default: 1)",
    )
    p.add_argument(
        "--pcp-spread-min-rows",
        type=nonnegative_int,
        metavar="N",
        help="override ctxpar's pcp_spread_min_rows (with --pcp > 1)",
    )
    p.add_argument(
        "--vs-pcp",
        type=int_arg(1, max_threads()),
        metavar="P0",
        help="compare against ctxpar with P0 ranks (same threads) instead of transformers",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        metavar="N",
        help="with --vs-pcp: alternating rounds of both setups, the best of each kept (default: 2)",
    )
    p.add_argument("--skip-hf", action="store_true", help="run ctxpar only")
    p.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn ctxpar's prefix caching off (random prompts barely hit it anyway)",
    )
    p.add_argument("--hf-batched", action="store_true", help="run transformers as one left-padded batch")


def make_prompts(tokenizer, vocab_size: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """Seeded prompts of random real (non-special) token ids, lengths in [lo, hi]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else set()
    pool = np.array([t for t in range(vocab_size) if t not in special])
    lengths = rng.integers(lo, hi + 1, n)
    return [rng.choice(pool, int(k)).tolist() for k in lengths]


def llm_prompts(llm: Any, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """make_prompts for the model an open ``LLM`` serves."""
    return make_prompts(llm.get_tokenizer(), vocab_size(llm), n, lo, hi, seed)


def load_hf(model: str | None):
    """The same weights in transformers, fp32 (a GGUF is dequantised by transformers itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ctxpar.models.loader import default_model_path

    path = Path(model) if model is not None else default_model_path()
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


class _FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt itself
            self.first = time.perf_counter()

    def since(self, t0: float) -> float:
        """Seconds from t0 to the first generated token."""
        if self.first is None:
            raise RuntimeError("generate produced no token")
        return self.first - t0

    def end(self) -> None:
        pass


def run_hf(hf, prompts: list[list[int]], output_len: int, batched: bool) -> dict:
    import torch

    gen = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, eos_token_id=None, pad_token_id=0)
    outputs, ttft, ttft_alone = [], [], []
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        if batched:
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            timer = _FirstTokenTimer()
            out = hf.generate(ids, attention_mask=mask, streamer=timer, **gen)
            outputs = [row[width:].tolist() for row in out]
            ttft = ttft_alone = [timer.since(t0)] * len(prompts)
        else:
            for p in prompts:
                timer, start = _FirstTokenTimer(), time.perf_counter()
                mask = torch.ones(1, len(p), dtype=torch.long)
                out = hf.generate(torch.tensor([p]), attention_mask=mask, streamer=timer, **gen)
                outputs.append(out[0, len(p) :].tolist())
                ttft.append(timer.since(t0))
                ttft_alone.append(timer.since(start))
        elapsed = time.perf_counter() - t0
    return dict(outputs=outputs, elapsed=elapsed, ttft=ttft, ttft_alone=ttft_alone)


def hf_prefill(hf, prompt: list[int]) -> float:
    """One forward pass over the prompt (logits of the last token only, as generate does)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf(ids[:, :64], logits_to_keep=1)  # warm-up
        t = time.perf_counter()
        hf(ids, logits_to_keep=1)
        return time.perf_counter() - t


def run_ctxpar(args: argparse.Namespace, pcp: int, threads: int) -> dict:
    """The workload through ctxpar with `pcp` ranks sharing `threads` threads:
    outputs, throughput, mean TTFT, and the prefill time of one long prompt."""
    from ctxpar import LLM, SamplingParams

    spread = {} if args.pcp_spread_min_rows is None else dict(pcp_spread_min_rows=args.pcp_spread_min_rows)
    with LLM(
        args.model,
        pcp_size=pcp,
        num_threads=max(1, threads // pcp),
        enable_prefix_caching=args.enable_prefix_caching,
        quantization="none",  # a GGUF dequantized: the figures of docs/benchmarks.md, and vLLM's model
        **spread,
    ) as llm:
        prompts = llm_prompts(llm, args.num_prompts, args.min_prompt_len, args.max_prompt_len, args.seed)
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        print(
            f"model {model_name(llm)}, {threads} threads over {pcp} rank(s), "
            f"{len(prompts)} prompts of {min(map(len, prompts))}-"
            f"{max(map(len, prompts))} tokens (sum {sum(map(len, prompts))}), {args.output_len} output tokens each"
        )
        llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        ours = [o.outputs[0].token_ids for o in outs]
        tps, ttft = sum(map(len, ours)) / elapsed, sum(first_token_seconds(o) for o in outs) / len(outs)
        print(f"ctxpar P={pcp}:   {tps:8.1f} output tok/s  mean TTFT {ttft:6.2f} s  ({elapsed:.1f} s)")
        pre, long = None, None
        if args.prefill_len:
            n = args.prefill_len
            [long] = llm_prompts(llm, 1, n, n, args.seed + 1)
            [o] = llm.generate({"prompt_token_ids": long}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            pre = first_token_seconds(o)
            print(f"ctxpar P={pcp} prefill of {len(long)} tokens: {pre:.3f} s ({len(long) / pre:.0f} tok/s)")
    return dict(prompts=prompts, outputs=ours, tps=tps, ttft=ttft, prefill=pre, long=long)


def compare_pcp(args: argparse.Namespace, threads: int) -> None:
    """--pcp P against --vs-pcp P0 on the same workload, rounds alternating."""
    runs: dict[int, list[dict]] = {args.vs_pcp: [], args.pcp: []}
    for r in range(args.rounds):
        for pcp in runs:
            print(f"round {r + 1}, P={pcp}:")
            runs[pcp].append(run_ctxpar(args, pcp, threads))
    best = {pcp: max(rs, key=lambda x: x["tps"]) for pcp, rs in runs.items()}
    base, ours = best[args.vs_pcp], best[args.pcp]
    same = sum(a == b for a, b in zip(base["outputs"], ours["outputs"]))
    print(f"token-identical requests: {same}/{len(base['outputs'])}")
    print(
        f"ratios (above 1: P={args.pcp} better; best of {args.rounds} runs each): throughput "
        f"P={args.pcp}/P={args.vs_pcp} {ours['tps'] / base['tps']:.2f}x, "
        f"mean TTFT P={args.vs_pcp}/P={args.pcp} {base['ttft'] / ours['ttft']:.2f}x"
    )
    if ours["prefill"] is not None:
        first = {pcp: min(x["prefill"] for x in rs) for pcp, rs in runs.items()}
        print(
            f"ratio (above 1: P={args.pcp} faster): prefill time P={args.vs_pcp}/P={args.pcp} "
            f"{first[args.vs_pcp] / first[args.pcp]:.2f}x"
        )


def run(args: argparse.Namespace) -> None:
    import torch

    from ctxpar.bench.machine_line import describe_machine
    from ctxpar.errors import CtxparError

    if args.min_prompt_len > args.max_prompt_len:
        raise CtxparError(
            f"need --min-prompt-len <= --max-prompt-len, got {args.min_prompt_len} and {args.max_prompt_len}"
        )
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    print(describe_machine())
    if args.vs_pcp is not None:
        compare_pcp(args, threads)
        return
    mine = run_ctxpar(args, args.pcp, threads)
    prompts, ours, c_tps, c_ttft, pre, long = (
        mine[k] for k in ("prompts", "outputs", "tps", "ttft", "prefill", "long")
    )
    if args.skip_hf:
        return

    hf = load_hf(args.model)
    mode = "one left-padded batch" if args.hf_batched else "batch size 1, sequential"
    r = run_hf(hf, prompts, args.output_len, args.hf_batched)
    h_n = sum(map(len, r["outputs"]))
    h_tps, h_ttft = h_n / r["elapsed"], sum(r["ttft"]) / len(prompts)
    print(
        f"transformers:  {h_tps:8.1f} output tok/s  mean TTFT {h_ttft:6.2f} s  ({r['elapsed']:.1f} s, {mode}; "
        f"mean TTFT alone {sum(r['ttft_alone']) / len(prompts):.2f} s)"
    )
    same = sum(a == b for a, b in zip(ours, r["outputs"]))
    print(f"token-identical requests: {same}/{len(prompts)}")
    print(
        f"ratios (above 1: ctxpar better): throughput ctxpar/transformers {c_tps / h_tps:.2f}x, "
        f"mean TTFT transformers/ctxpar {h_ttft / c_ttft:.2f}x"
    )
    if pre is not None:
        h_pre = hf_prefill(hf, long)
        print(f"transformers prefill of {len(long)} tokens: {h_pre:.3f} s ({len(long) / h_pre:.0f} tok/s)")
        print(f"ratio (above 1: ctxpar faster): prefill time transformers/ctxpar {h_pre / pre:.2f}x")
