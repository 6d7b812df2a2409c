"""ctxpar against llama.cpp on GGUFs of real models' shapes (random weights):
loading (cold and warm), peak memory, time to first token and decode.

Each file is written once (bench/gguf_shapes.py: SmolLM2 135M (a 128K context), Llama 3.2 1B and 3 8B, Qwen2.5
1.5B, Qwen3 1.7B, Qwen3-30B-A3B's layers, Phi-3-mini, Gemma 3 1B, DeepSeek-V2-Lite,
at Q4_0, Q8_0 or Q4_K, each in its family's own GGUF architecture; SmolLM2's
vocabulary), into ``--dir``. Each
engine then runs in its own process (bench/compare_workload.py, the same
script under both Pythons): a cold load first, after the file, and ctxpar's
converted tokenizer, are evicted from the page cache (``posix_fadvise``, as
bench/cold_start.py: a restart's load, the tokenizer converted before it, not a
first load's conversion), then a warm run that loads again and times one prompt
per ``--contexts`` length and ``--decode-tokens`` tokens after the first of them.
Peak RSS is the process's own (``ru_maxrss``): a mapped file's pages count
while mapped. Figures: each engine's, and ctxpar's over llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ctxpar.bench.cold_start import evict
from ctxpar.bench.engine_process import run_engine
from ctxpar.bench.gguf_shapes import FORMATS, SHAPES, is_written, write_gguf
from ctxpar.checks import positive_int
from ctxpar.errors import CtxparError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes",
        nargs="+",
        choices=list(SHAPES),
        default=["llama-3.2-1b"],
        help="model shapes, each written in its family's GGUF architecture (gguf_shapes.py's ARCHS)",
    )
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), default=["Q4_0"], help="block formats")
    p.add_argument("--dir", default=None, help="where the GGUFs are written (default: a private cache directory)")
    p.add_argument("--peer-python", default=None, help="Python of a venv with llama-cpp-python (default: ctxpar only)")
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[2048], help="prompt lengths timed (TTFT)")
    p.add_argument("--decode-tokens", type=positive_int, default=16, help="tokens timed after the first prompt")
    p.add_argument("--pcp", type=positive_int, nargs="+", default=[1], help="ctxpar's prefill ranks, one run each")


def run(args: argparse.Namespace) -> None:
    from ctxpar import paths
    from ctxpar.bench.machine_line import describe_machine
    from ctxpar.models.loader import default_model_path

    if args.peer_python is not None and not Path(args.peer_python).exists():
        raise CtxparError(f"--peer-python {args.peer_python} does not exist; point it at llama-cpp-python's venv")
    folder = Path(args.dir) if args.dir else paths.cache_dir("gguf-shapes") or paths.temporary_dir("gguf-shapes")
    folder.mkdir(parents=True, exist_ok=True)
    print(describe_machine())
    for shape in args.shapes:
        for fmt in args.formats:
            path = folder / f"{shape}-{fmt}.gguf"
            if not is_written(shape, path):
                print(f"writing {path} ...", flush=True)
                write_gguf(shape, fmt, path, default_model_path())
            _compare(path, args)


def _compare(path: Path, args: argparse.Namespace) -> None:
    import numpy as np

    size = path.stat().st_size
    rng = np.random.default_rng(0)
    vocab = 49152  # SmolLM2's, every file's (gguf_shapes)
    n = max(args.contexts)
    spec = {
        "model": str(path),
        "quantization": "gguf",
        "max_model_len": n + args.decode_tokens + 16,
        # One request at a time: a cache of that context, as llama.cpp's n_ctx (the default 1 GiB
        # holds under 16K tokens of an 8B shape's int8 KV).
        "kv_cache_fits_one": True,
        "prompts": {c: rng.integers(100, vocab, size=c).tolist() for c in args.contexts},
        "ttft": args.contexts,
        "decode_after": [min(args.contexts)],
        "decode_tokens": args.decode_tokens,
        "repeat": 1,
    }
    engines = [("ctxpar" if p == 1 else f"ctxpar-p{p}", sys.executable) for p in dict.fromkeys(args.pcp)]
    if args.peer_python:
        engines.append(("llama.cpp", args.peer_python))
    rows: dict[str, dict[str, str]] = {}
    for engine, python in engines:
        cold = _cold_load(python, engine, spec)
        res = _run(python, engine, spec)
        label = "ctxpar P=" + (engine.partition("-p")[2] or "1") if engine.startswith("ctxpar") else "llama.cpp"
        rows[label] = {
            "load, cold (s)": f"{cold[0]:.2f}",
            "load, warm (s)": f"{res['load_s']:.2f}",
            "peak RSS (GB)": f"{res['peak_rss'] / 1e9:.2f}",
            **{f"TTFT, {c} tokens (s)": f"{res['figures'][f'ttft_{c}']:.2f}" for c in args.contexts},
            f"decode after {min(args.contexts)} (ms/token)": f"{res['figures'][f'decode_{min(args.contexts)}']:.1f}",
        }
        print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in rows[label].items()), flush=True)
    _report(path.name, size, rows)


def _run(python: str, engine: str, spec: dict) -> dict:
    """compare_workload.py's run of ``spec`` by ``engine`` under ``python``."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        return run_engine(python, engine, f.name, dict(os.environ))


def _cold_load(python: str, engine: str, spec: dict) -> tuple[float, int]:
    """(load seconds, peak RSS) with the model file and ctxpar's converted tokenizer out of the page cache."""
    from ctxpar.models.gguf import gguf_to_hf_dir

    path = Path(spec["model"])
    converted, temporary = gguf_to_hf_dir(path)  # what a restart finds cached
    if temporary:  # the cache refused: every load converts afresh, nothing of it to evict
        shutil.rmtree(converted, ignore_errors=True)
    evict([path, *(f for f in converted.glob("*") if f.is_file())])
    res = _run(python, engine, {**spec, "load_only": True})
    return res["load_s"], res["peak_rss"]


def _report(name: str, size: int, rows: dict[str, dict[str, str]]) -> None:
    labels = list(rows)
    print(f"\n{name} ({size / 1e9:.2f} GB)")
    print(
        f"{'':34}"
        + "".join(f"{label:>16}" for label in labels)
        + ("   ctxpar / llama.cpp" if "llama.cpp" in rows else "")
    )
    for key in rows[labels[0]]:
        values = [rows[label][key] for label in labels]
        line = f"{key:34}" + "".join(f"{v:>16}" for v in values)
        if "llama.cpp" in rows:
            line += f"   {float(rows[labels[0]][key]) / float(rows['llama.cpp'][key]):.2f}x"
        print(line)
