"""bf16 projections on each path this CPU has, at SmolLM2's shapes.

- **tiles**: AMX's tiles (kernels/bf16_tiles.h), which every bf16 projection
  takes on a CPU with AMX-BF16;
- **panels**: the panel loop of AVX-512 BF16 dot products (kernels/gemv.cpp),
  which CPUs without AMX take; on a CPU with AMX, the kernels built for one
  without (``-march=cooperlake``), the same code the native build ran before
  the tiles;
- **oneDNN**: ``F.linear`` on the plain bf16 weights (PyTorch's AMX path here),
  which ctxpar does not use: its bits for a row depend on the number of rows.

Each case times a Llama layer's four projections (QKV, O, gate|up, down) on n
rows, the paths interleaved, best of ``--repeat``; decode sizes run SmolLM2's
30 layers so the weights stream as in a real step. ``--e2e`` then times
``LLM(quantization="none", dtype="bfloat16")`` with the tiles and with the
panels, interleaved in one process: the time to the first token of a
``--prompt-tokens`` prompt and ms per token of ``--decode-tokens`` tokens after
it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F

from ctxpar import LLM, SamplingParams, TokensPrompt, kernels
from ctxpar.bench.machine_line import describe_machine
from ctxpar.checks import positive_int
from ctxpar.errors import CtxparError
from ctxpar.kernels import panels
from ctxpar.layers.linear import PanelWeight, linear
from ctxpar.machine import cpu_info

HIDDEN, INTER, QKV = 576, 1536, 960  # SmolLM2-135M: 9 + 2 x 3 heads of 64
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
CASES = ((1, 30), (16, 30), (512, 2), (2048, 2))  # (rows, layers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=positive_int, default=7, help="timed runs per case and path (best kept)")
    parser.add_argument("--e2e", action="store_true", help="also TTFT and decode of a bf16 SmolLM2, tiles vs panels")
    parser.add_argument("--prompt-tokens", type=positive_int, default=2048, help="--e2e: the prompt's length")
    parser.add_argument("--decode-tokens", type=positive_int, default=64, help="--e2e: tokens timed after the first")


@contextlib.contextmanager
def _build(march: str | None) -> Iterator[None]:
    """Every kernel call in the block goes to the kernels built for `march` (None: this
    CPU's). The library's loader is private; swapping it is how one process times two
    of this CPU's paths on the same weights and model."""
    if march is None:
        yield
        return
    lib, native = kernels._library(march), kernels._library
    if lib is None:
        raise CtxparError(f"the kernels could not be built for -march={march}")
    kernels._library = lambda march="native": lib  # type: ignore[assignment]
    try:
        yield
    finally:
        kernels._library = native


def _paths() -> dict[str, str | None]:
    """The kernel paths to time: name -> the build that runs it (None: native)."""
    if not kernels.available():
        raise CtxparError("ctxpar's kernels are not available here (CTXPAR_KERNELS=0, or no C++ compiler)")
    if not panels.bf16_tiles():
        return {"panels": None}
    if "avx512_bf16" in cpu_info().flags:
        return {"tiles": None, "panels": "cooperlake"}
    return {"tiles": None}


def _layers(rows: int, layers: int, g: torch.Generator) -> dict[str, Callable[[], None]]:
    """One call per path of every projection of `layers` layers on `rows` rows."""
    weights = [
        {k: (torch.randn(s, generator=g) / s[1] ** 0.5).bfloat16() for k, s in SHAPES.items()} for _ in range(layers)
    ]
    xs = {k: torch.randn(rows, s[1], generator=g).bfloat16() for k, s in SHAPES.items()}
    panels = [{k: PanelWeight.pack(w) for k, w in layer.items()} for layer in weights]  # one width for every build

    def ours(march: str | None) -> Callable[[], None]:
        def run() -> None:
            with _build(march):
                for layer in panels:
                    for k, w in layer.items():
                        linear(xs[k], w)

        return run

    def onednn() -> None:
        for layer in weights:
            for k, w in layer.items():
                F.linear(xs[k], w)

    return {**{name: ours(march) for name, march in _paths().items()}, "oneDNN": onednn}


def _best(fns: Mapping[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best seconds of each, the functions interleaved (a warm-up call each first)."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _projections(repeat: int) -> None:
    g = torch.Generator().manual_seed(0)
    flops_per_row = 2 * sum(o * i for o, i in SHAPES.values())
    names = [*_paths(), "oneDNN"]
    print(f"{'rows x layers':>14} | " + " | ".join(f"{n + ' ms':>10}" for n in names) + " | per layer; GFLOP/s")
    for rows, layers in CASES:
        best = _best(_layers(rows, layers, g), repeat)
        ms = " | ".join(f"{best[n] / layers * 1e3:10.3f}" for n in names)
        rates = ", ".join(f"{n} {flops_per_row * rows * layers / best[n] / 1e9:.0f}" for n in names)
        print(f"{rows:>6} x {layers:<5} | {ms} | {rates}")


def _end_to_end(args: argparse.Namespace) -> None:
    n, k = args.prompt_tokens, args.decode_tokens
    llm = LLM(quantization="none", dtype="bfloat16", enable_prefix_caching=False, max_model_len=n + k + 16)
    engine = llm.llm_engine
    assert engine is not None
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(n)]
    prompt = TokensPrompt(prompt_token_ids=ids)
    greedy = lambda tokens: SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}

    def ttft() -> None:
        llm.generate([prompt], greedy(1), use_tqdm=False)

    def decode(name: str) -> float:
        """Seconds from the first token to the (1 + k)-th, the engine stepped by hand (the
        prefill, whose noise would swamp k steps, outside the clock)."""
        engine.add_request(f"{name}-{time.perf_counter_ns()}", prompt, greedy(1 + k))
        first, out = 0.0, list[int]()  # first: when the first token came
        while len(out) < 1 + k:
            for o in engine.step():
                out = list(o.outputs[0].token_ids)
            if not first and out:
                first = time.perf_counter()
        tokens[name] = out
        return time.perf_counter() - first

    paths = _paths()
    for march in paths.values():  # warm-up: first-call allocations, the kernels' builds
        with _build(march):
            llm.generate([TokensPrompt(prompt_token_ids=ids[:64])], greedy(2), use_tqdm=False)
    first = {name: float("inf") for name in paths}
    step = {name: float("inf") for name in paths}
    for _ in range(args.repeat):
        for name, march in paths.items():
            with _build(march):
                t0 = time.perf_counter()
                ttft()
                first[name] = min(first[name], time.perf_counter() - t0)
                step[name] = min(step[name], decode(name) / k)
    print(f"SmolLM2 bf16, TTFT of {n} tokens and ms per token of {k} after them, best of {args.repeat}:")
    for name in paths:
        print(f"{name:>8}: TTFT {first[name]:.3f} s, decode {step[name] * 1e3:.2f} ms/token")
    if len(paths) == 2:
        a, b = paths
        print(
            f"{a}/{b}: TTFT {first[a] / first[b]:.2f}x, decode {step[a] / step[b]:.2f}x; "
            f"the same {k + 1} tokens: {tokens[a] == tokens[b]}"
        )


def run(args: argparse.Namespace) -> None:
    print(describe_machine())
    print(f"{torch.get_num_threads()} threads; bf16 projections of SmolLM2's shapes (out, in) {SHAPES}")
    _projections(args.repeat)
    if args.e2e:
        _end_to_end(args)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
