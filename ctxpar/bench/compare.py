"""ctxpar against a peer engine on this machine: one fixed workload through
both engines, each in its own process, interleaved, same token ids, greedy.

Figures: TTFT at 2K and 6K tokens, decode ms/token after 2K and after 16
tokens, output tokens/s of a 16-prompt batch; ratios ctxpar / peer; whether
the generated tokens are identical; the CPU model and flags. ``--pcp 1 2``
adds ctxpar with 2 prefill context-parallel ranks (the cores shared out
between them), its figures against the same peer run, and whether its tokens
are those of one rank.

Peers (``--peer``), never dependencies: each runs under ``--peer-python``, a
Python with the peer installed apart from the project (docs/benchmarks.md
says how):

- ``vllm``: vLLM's CPU build; both engines read the same converted checkpoint
  in fp32, or with ``--dtype bfloat16`` in bf16 (on a CPU with AMX-BF16, both
  engines' projections run on its tiles).
- ``llama.cpp``: llama-cpp-python; both engines read the same GGUF file and
  keep it quantized (ctxpar: ``quantization="gguf"``). Adds the perplexity of
  real English text (Python's own documentation, ``pydoc_data.topics``) and
  real source code (``argparse.py`` of this Python), first ``--ppl-tokens``
  tokens each, and ctxpar's perplexity of the same file dequantized to fp32.

Timing on a machine that other processes keep busy measures them, not the
engines: the benchmark refuses to start a run while the CPU is busier than
``--max-busy``, unless ``--allow-busy``; it prints the load next to the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ctxpar.bench.engine_process import run_engine
from ctxpar.checks import int_arg, positive_int
from ctxpar.errors import CtxparError

PEER_ENV = {  # vLLM's CPU backend on this machine's two cores, as issue 9 measured it
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
}
PEERS = {"vllm": "vLLM CPU", "llama.cpp": "llama.cpp"}
ROWS = (  # (figure key, label, unit, True if higher is better)
    ("ttft_2048", "TTFT, 2048-token prompt", "s", False),
    ("ttft_6000", "TTFT, 6000-token prompt", "s", False),
    ("decode_2048", "decode after 2048 tokens", "ms/token", False),
    ("decode_16", "decode after 16 tokens", "ms/token", False),
    ("batch", "16 prompts (65-1003 tokens) x 64 tokens", "out tok/s", True),
    ("ppl_english", "perplexity, English (pydoc topics)", "", False),
    ("ppl_code", "perplexity, Python source (argparse)", "", False),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", choices=sorted(PEERS), default="vllm", help="the engine to compare with (default: vllm)")
    p.add_argument("--peer-python", required=True, help="Python executable of a venv with the peer installed")
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument(
        "--ppl-tokens", type=positive_int, default=2048, metavar="N", help="tokens per perplexity text (llama.cpp)"
    )
    p.add_argument(
        "--pcp",
        type=positive_int,
        nargs="+",
        default=[1],
        metavar="P",
        help="ctxpar's prefill context-parallel ranks, one ctxpar run each (default: 1)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and activations of both engines (vllm; bfloat16: the matrix units' path where the CPU has one)",
    )
    p.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds (each engine once per round)")
    p.add_argument("--repeat", type=positive_int, default=2, help="timed runs per figure inside a round (best kept)")
    p.add_argument("--decode-tokens", type=positive_int, default=32, help="tokens timed per decode figure")
    p.add_argument(
        "--max-busy",
        type=int_arg(1, 100),
        default=15,
        metavar="PCT",
        help="refuse to time while other processes use more than PCT%% of the CPU (default: 15)",
    )
    p.add_argument(
        "--allow-busy",
        action="store_true",
        help="time anyway on a busy machine (figures are then noisy: the load is printed)",
    )


def cpu_busy(seconds: float = 1.0) -> float:
    """Share of all cores busy over `seconds`, from /proc/stat (0..1)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + v[4]  # idle + iowait
        return sum(v) - idle, sum(v)

    b0, t0 = sample()
    time.sleep(seconds)
    b1, t1 = sample()
    return (b1 - b0) / max(t1 - t0, 1)


def _spec(model: str, hf_dir: str, tokenizer_vocab: int, args: argparse.Namespace) -> dict:
    """The workload; model: what the engines load (the HF directory, or the GGUF file for
    llama.cpp); hf_dir: the HF directory whose tokenizer makes the perplexity texts' ids."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(100, tokenizer_vocab, size=n).tolist()  # low ids hold the special tokens
    lengths = np.linspace(65, 1003, 16).astype(int)
    extra = {}
    if args.peer == "llama.cpp":
        extra = {"quantization": "gguf", "perplexity": _perplexity_texts(hf_dir, args.ppl_tokens)}
    return {
        **extra,
        "model": model,
        "dtype": args.dtype,
        "max_model_len": 8192,
        "prompts": {n: ids(n) for n in (16, 2048, 6000)},
        "ttft": [2048, 6000],
        "decode_after": [2048, 16],
        "decode_tokens": args.decode_tokens,
        "batch_prompts": [ids(int(n)) for n in lengths],
        "batch_max_tokens": 64,
        "repeat": args.repeat,
    }


def _perplexity_texts(hf_dir: str, n: int) -> dict[str, list[int]]:
    """The first n token ids of real English prose and real code, tokenized by the model's tokenizer."""
    from transformers import AutoTokenizer

    from ctxpar.bench.perplexity import perplexity_texts

    return perplexity_texts(AutoTokenizer.from_pretrained(hf_dir), n)


def model_dir(model: str | None) -> tuple[str, int]:
    """An HF directory both engines load (a GGUF file is converted once, cached), and its vocab size."""
    from transformers import AutoConfig

    from ctxpar.models import gguf
    from ctxpar.models.loader import default_model_path

    path = Path(model) if model else default_model_path()
    if path.is_file() and gguf.is_gguf(path):
        path, temporary = gguf.gguf_to_hf_dir(path, with_weights=True)
        if temporary:
            raise CtxparError(f"cannot cache the converted {model}: set CTXPAR_CACHE to a writable directory")
    return str(path), AutoConfig.from_pretrained(path).vocab_size


def _wait_for_idle(args: argparse.Namespace) -> float:
    busy = cpu_busy()
    if busy > args.max_busy / 100 and not args.allow_busy:
        raise CtxparError(
            f"the CPU is {busy:.0%} busy with other processes (limit --max-busy {args.max_busy}%): "
            "timings would measure them; wait for an idle machine, or pass --allow-busy to time anyway"
        )
    return busy


def run(args: argparse.Namespace) -> None:
    from ctxpar.bench.machine_line import describe_machine

    if not Path(args.peer_python).exists():
        raise CtxparError(f"--peer-python {args.peer_python} does not exist; point it at the {args.peer} venv's python")
    if args.peer == "llama.cpp" and args.dtype != "float32":
        raise CtxparError("--dtype applies to --peer vllm; against llama.cpp both engines keep the GGUF's blocks")
    hf_dir, vocab = model_dir(args.model)
    model = str(_gguf_path(args.model)) if args.peer == "llama.cpp" else hf_dir  # llama.cpp: the very GGUF file
    print(describe_machine())
    print(f"dtype: {args.dtype}" if args.peer == "vllm" else "weights: the GGUF's blocks, in both engines")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(_spec(model, hf_dir, vocab, args), f)
    ours = [_ctxpar_engine(p) for p in dict.fromkeys(args.pcp)]
    results: dict[str, list[dict]] = {name: [] for name in [*ours, args.peer]}
    busy_seen: list[float] = []
    try:
        for r in range(args.rounds):
            for engine, python in [*((name, sys.executable) for name in ours), (args.peer, args.peer_python)]:
                busy_seen.append(_wait_for_idle(args))
                env = {**os.environ, **(PEER_ENV if engine == "vllm" else {})}
                res = run_engine(python, engine, f.name, env)
                res["load"] = os.getloadavg()[0]
                results[engine].append(res)
                print(
                    f"round {r + 1} {engine}: loaded in {res['load_s']:.1f} s, "
                    + ", ".join(f"{k} {v:.3g}" for k, v in res["figures"].items())
                    + f" (load average {res['load']:.1f})"
                )
    finally:
        os.unlink(f.name)
    _report(results, busy_seen, args.peer)


def _ctxpar_engine(pcp: int) -> str:
    """compare_workload.py's name of ctxpar with `pcp` ranks."""
    return "ctxpar" if pcp == 1 else f"ctxpar-p{pcp}"


def _gguf_path(model: str | None) -> Path:
    from ctxpar.models import gguf
    from ctxpar.models.loader import default_model_path

    path = Path(model) if model else default_model_path()
    if not (path.is_file() and gguf.is_gguf(path)):
        raise CtxparError(f"--peer llama.cpp reads a GGUF file; {path} is not one (pass --model FILE.gguf)")
    return path


def _report(results: dict[str, list[dict]], busy_seen: list[float], peer: str) -> None:
    name = PEERS[peer]
    ours = [e for e in results if e.startswith("ctxpar")]
    label_of = lambda e: "ctxpar P=" + (e.partition("-p")[2] or "1")  # noqa: E731
    print(f"\nother processes kept the CPU {min(busy_seen):.0%}-{max(busy_seen):.0%} busy before the runs")
    print(f"{'':42} {name:>12}" + "".join(f" {label_of(e):>12} {'x peer':>20}" for e in ours))
    for key, label, unit, higher in ROWS:
        if key not in results[peer][0]["figures"]:
            continue
        best = max if higher else min
        v = best(r["figures"][key] for r in results[peer])
        line = f"{label:42} {v:9.3g} {unit:<2}"
        for e in ours:
            if key not in results[e][0]["figures"]:
                line += f" {'-':>12} {'':20}"
                continue
            c = best(r["figures"][key] for r in results[e])
            ratio = c / v
            verdict = ("faster" if ratio > 1 else "slower") if higher else ("faster" if ratio < 1 else "slower")
            if key.startswith("ppl_"):  # not a speed: within 1% is the same quality
                verdict = "same" if abs(ratio - 1) <= 0.01 else ("lower" if ratio < 1 else "higher")
            line += f" {c:9.3g} {unit:<2} {ratio:8.2f}x ({verdict:>7})"
        print(line)
    figures = results["ctxpar"][0]["figures"] if "ctxpar" in results else {}
    for key in figures:
        if key.endswith("_dequantized"):  # ctxpar's own fp32 run of the same file: the quantization gap
            fp32, quant = figures[key], figures[key[: -len("_dequantized")]]
            print(f"{'ctxpar ' + key + ' (fp32)':42} {'':12} {fp32:9.4g}     quantized / fp32 {quant / fp32:.4f}")
    load = min(r["load_s"] for r in results[peer])
    line = f"{'start-up (engine construction)':42} {load:9.3g} s "
    for e in ours:
        mine = min(r["load_s"] for r in results[e])
        line += f" {mine:9.3g} s  {mine / load:8.2f}x {'':10}"
    print(line)
    for e in ours:
        print(f"token identity, {label_of(e)}: {_same_tokens(results[e][-1], results[peer][-1])} vs {name}", end="")
        if e != ours[0]:
            print(f", {_same_tokens(results[e][-1], results[ours[0]][-1])} vs {label_of(ours[0])}", end="")
        print()


def _same_tokens(a: dict, b: dict) -> str:
    """'k/n generated sequences identical' between two runs' tokens."""
    same, total = 0, 0
    for key in a["tokens"]:
        x, y = a["tokens"][key], b["tokens"][key]  # lists of sequences
        total += len(x)
        same += sum(p == q for p, q in zip(x, y))
    return f"{same}/{total} generated sequences identical"
