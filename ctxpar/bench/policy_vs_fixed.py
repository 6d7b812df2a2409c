"""The automatic PCP policy against fixed settings, on three workloads, in one run.

A random model of SmolLM2-135M's shapes with ``--layers`` layers (fp32) runs at
P ranks on this host (shared memory), each setting in an engine of its own:

- ``auto``: the defaults: pcp_min_tokens and pcp_spread_min_rows derived from the
  cost model, each step's split prompts grouped over the ranks as it predicts best;
- fixed: pcp_split_mode ``all`` (every split prompt over all ranks), ``disjoint``
  and ``whole``, each with the constants the engine had before (pcp_min_tokens 128,
  pcp_spread_min_rows 64); ``split-all``: every prompt split (pcp_min_tokens 0,
  over all ranks); ``split-none``: no prompt split.

Workloads, all requests submitted at once, ``--output-len`` greedy tokens each:
``mixed`` (P long prompts and 4P short ones), ``long`` (P long prompts), ``short``
(6P short prompts). One engine at a time (a process holds one group of ranks):
``--rounds`` rounds, each starting every setting's engine in turn, which runs
every workload ``--repeat`` times, so a busy moment of a shared machine hits
the settings alike; each round starts one setting later than the one before, so
with a multiple of six rounds every setting takes every place in a round once.
Printed: each setting's best time and its ratio to auto's
(above 1: auto is faster).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from ctxpar.checks import positive_int

FIXED = {
    "all": dict(pcp_min_tokens=128, pcp_spread_min_rows=64, pcp_split_mode="all"),
    "disjoint": dict(pcp_min_tokens=128, pcp_spread_min_rows=64, pcp_split_mode="disjoint"),
    "whole": dict(pcp_min_tokens=128, pcp_spread_min_rows=64, pcp_split_mode="whole"),
    "split-all": dict(pcp_min_tokens=0, pcp_spread_min_rows=64, pcp_split_mode="all"),
    "split-none": dict(pcp_min_tokens=1 << 30, pcp_spread_min_rows=64, pcp_split_mode="all"),
}
SETTINGS: dict[str, dict] = {"auto": {}, **FIXED}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--pcp", type=positive_int, nargs="+", default=[2], metavar="P", help="rank counts (2)")
    p.add_argument("--layers", type=positive_int, default=4, metavar="N", help="layers of the random model (4)")
    p.add_argument("--long", type=positive_int, default=1024, metavar="N", help="tokens of a long prompt (1024)")
    p.add_argument("--short", type=positive_int, default=48, metavar="N", help="tokens of a short prompt (48)")
    p.add_argument("--output-len", type=positive_int, default=4, metavar="N", help="tokens generated each (4)")
    p.add_argument("--rounds", type=positive_int, default=2, metavar="N", help="engines of every setting (2)")
    p.add_argument("--repeat", type=positive_int, default=3, metavar="N", help="runs of a workload per engine (3)")


def _workloads(pcp: int, long: int, short: int, seed: int = 0) -> dict[str, list[list[int]]]:
    import numpy as np

    from ctxpar.bench.long import SMOLLM2_SHAPES

    rng = np.random.default_rng(seed)

    def prompts(n: int, length: int) -> list[list[int]]:
        return rng.integers(0, SMOLLM2_SHAPES["vocab_size"], (n, length)).tolist()

    return {
        "mixed": prompts(pcp, long) + prompts(4 * pcp, short),
        "long": prompts(pcp, long),
        "short": prompts(6 * pcp, short),
    }


def _best_times(model: str, pcp: int, workloads: dict, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """{setting: {workload: best seconds of one generate call of all its prompts}}."""
    best = {s: {w: float("inf") for w in workloads} for s in SETTINGS}
    names = list(SETTINGS)
    for rnd in range(args.rounds):
        # Each round starts one setting later: an engine's place in the round (the first
        # after a pause, the last after five others' start-ups) falls on every setting alike.
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            setting = SETTINGS[name]
            print(f"  P={pcp} round {rnd + 1} of {args.rounds}: {name}", flush=True)
            for w, t in _engine_times(model, pcp, setting, workloads, args).items():
                best[name][w] = min(best[name][w], t)
    return best


def _engine_times(model: str, pcp: int, setting: dict, workloads: dict, args: argparse.Namespace) -> dict[str, float]:
    """Best seconds of each workload, ``--repeat`` runs, on one engine of this setting."""
    from ctxpar import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    budget = sum(len(p) for p in workloads["mixed"])  # a whole workload's prompts fit in one step
    # No prefix cache: every run computes its prompts in full.
    kwargs: dict[str, Any] = dict(num_threads=1, max_num_batched_tokens=budget, enable_prefix_caching=False)
    with LLM(model, pcp_size=pcp, **kwargs, **setting) as llm:
        if not setting:  # auto: what it derived (the ranks' options: printed by nothing public)
            assert llm.engine is not None  # open: inside its with block
            policy = llm.engine.executor.runner_options.policy
            print(f"    {policy.describe() if policy is not None else 'one rank'}", flush=True)
        llm.generate([{"prompt_token_ids": workloads["short"][0]}], params, use_tqdm=False)  # warm-up
        times = {w: float("inf") for w in workloads}
        for _ in range(args.repeat):
            for w, prompts in workloads.items():
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                times[w] = min(times[w], time.perf_counter() - t0)
    return times


def run(args: argparse.Namespace) -> None:
    from ctxpar.bench.long import save_smollm2_shaped
    from ctxpar.bench.machine_line import describe_machine

    print(describe_machine(), flush=True)
    print(
        f"{args.layers}-layer random model of SmolLM2's shapes (fp32), long prompts {args.long} tokens, "
        f"short {args.short}, {args.output_len} output tokens each; best of {args.rounds} engine(s) x "
        f"{args.repeat} run(s)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="ctxpar-policy-") as tmp:
        model = str(save_smollm2_shaped(Path(tmp), args.layers))
        for pcp in args.pcp:
            _report(pcp, _best_times(model, pcp, _workloads(pcp, args.long, args.short), args))


def _report(pcp: int, best: dict[str, dict[str, float]]) -> None:
    workloads = list(best["auto"])
    print(f"\nP={pcp}: seconds (setting / auto: above 1, auto is faster)")
    print(f"{'setting':>10} | " + " | ".join(f"{w:>16}" for w in workloads))
    for name, times in best.items():
        cells = [f"{times[w]:6.2f} ({times[w] / best['auto'][w]:.2f}x)" for w in workloads]
        print(f"{name:>10} | " + " | ".join(f"{c:>16}" for c in cells))
    for w in workloads:
        auto, fixed = best["auto"][w], min(best[s][w] for s in FIXED)
        print(f"{w}: auto {auto:.2f} s vs best fixed {fixed:.2f} s: auto/best = {auto / fixed:.3f}")
