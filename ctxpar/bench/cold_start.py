"""Cold start: from a process's start to the first token of a GGUF whose file is not
in the page cache, `ctxpar generate` against llama.cpp (llama-cpp-python) on the same
file, prompt and cores.

The file is a real model's shape with random weights (bench/gguf_shapes.py, written
once into ``--dir``), or ``--model``. Before every timed start its pages, and those
of ctxpar's converted tokenizer (models/gguf.py's cache), leave the page cache:
``posix_fadvise(POSIX_FADV_DONTNEED)``, which any user may ask of a file they can
read (pages another process maps stay: close servers of the same file first). A
first, untimed ctxpar run builds what ctxpar caches across starts (the converted
tokenizer, the kernels' library): a restart, not a first run; the first run's time
is printed apart where it converted the file.

Each start is a fresh process timed from its launch until the first byte of its
stdout: ``ctxpar generate --max-tokens 1`` writes the token's text (or the line's
end) as soon as it is sampled, and the llama.cpp script does the same. A third row
is the floor of any PyTorch engine: an interpreter that imports torch and exits.
Rounds are interleaved (each engine once a round); the median is printed, with the
load average, as other processes' work counts in every figure. So is the CPU time
each start had used by its first byte (its threads' user and system time, from
/proc): the work itself, which on a shared machine varies less than the wall time.
``--baseline`` times another checkout of ctxpar (its root directory, e.g. an older
commit's ``git archive``) as one more engine in the same rounds: a change's before
and after under the same load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ctxpar.bench.gguf_shapes import FORMATS, SHAPES, is_written, write_gguf
from ctxpar.checks import positive_int
from ctxpar.errors import CtxparError

# The llama.cpp side, run under --peer-python: load (mmap, the library's default), then
# one token of the prompt, its text written at once (a newline where it has none).
LLAMA_CPP = """
import sys
from llama_cpp import Llama
model, prompt, n_ctx, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
for chunk in llm(prompt, max_tokens=1, temperature=0.0, stream=True):
    sys.stdout.write(chunk["choices"][0]["text"] or "\\n")
    sys.stdout.flush()
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="FILE", help="a .gguf file (default: --shape's random weights)")
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b", help="model shape written (default)")
    p.add_argument("--format", choices=list(FORMATS), default="Q4_0", help="its block format (default: Q4_0)")
    p.add_argument("--dir", default=None, help="where the GGUF is written (default: a private cache directory)")
    p.add_argument("--peer-python", default=None, help="Python of a venv with llama-cpp-python (default: ctxpar only)")
    p.add_argument("--prompt", default="The capital of France is", help="the prompt both engines continue")
    p.add_argument("--max-model-len", type=positive_int, default=4096, help="context of both engines (default: 4096)")
    p.add_argument("--rounds", type=positive_int, default=3, help="timed starts of each engine (default: 3)")
    p.add_argument("--baseline", metavar="DIR", help="another ctxpar checkout's root, timed in the same rounds")


def run(args: argparse.Namespace) -> None:
    from ctxpar import paths
    from ctxpar.bench.machine_line import describe_machine
    from ctxpar.models.gguf import cache_dir_for
    from ctxpar.models.loader import default_model_path

    if args.peer_python is not None and not Path(args.peer_python).exists():
        raise CtxparError(f"--peer-python {args.peer_python} does not exist; point it at llama-cpp-python's venv")
    if args.model:
        path = Path(args.model)
        if not path.is_file():
            raise CtxparError(f"--model {path} is not a file; pass a .gguf file")
    else:
        folder = Path(args.dir) if args.dir else paths.cache_dir("gguf-shapes") or paths.temporary_dir("gguf-shapes")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{args.shape}-{args.format}.gguf"
        if not is_written(args.shape, path):  # a stale file of another architecture is rewritten
            print(f"writing {path} ...", flush=True)
            write_gguf(args.shape, args.format, path, default_model_path())
    print(describe_machine())
    threads = len(os.sched_getaffinity(0))
    engines = {
        "torch import (floor)": [sys.executable, "-c", "import torch; print(flush=True)"],
        "ctxpar generate": [
            *(sys.executable, "-m", "ctxpar.cli", "generate", "--model", str(path), "--prompt", args.prompt),
            *("--max-tokens", "1", "--ignore-eos", "--max-model-len", str(args.max_model_len)),
        ],
    }
    cwd: dict[str, Path] = {}
    if args.baseline:
        cwd["ctxpar baseline"] = _checkout(args.baseline)
        engines["ctxpar baseline"] = engines["ctxpar generate"]
    if args.peer_python:
        llama = [args.peer_python, "-I", "-c", LLAMA_CPP, str(path), args.prompt, str(args.max_model_len), str(threads)]
        engines["llama.cpp"] = llama
    converted = cache_dir_for(path)
    was_converted = converted.is_dir()
    first = _first_byte(engines["ctxpar generate"], [path])
    if not was_converted:
        print(f"first ctxpar run (converts the GGUF's tokenizer into its cache): {first.wall:.2f} s")
    if "ctxpar baseline" in cwd:  # its own kernel build and converted tokenizer, made untimed
        _first_byte(engines["ctxpar baseline"], [path], cwd["ctxpar baseline"])
    # Every converted directory of the file (the baseline's may be of another cache format).
    converted_dirs = paths.cache_root().joinpath("gguf").glob(f"{path.stem}-*")
    cold = [path, *(f for d in converted_dirs for f in d.glob("*") if f.is_file())]
    starts: dict[str, list[Start]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, cmd in engines.items():
            starts[name].append(_first_byte(cmd, cold, cwd.get(name)))
    size = path.stat().st_size / 1e9
    print(f"\n{path.name} ({size:.2f} GB), {threads} threads, cold page cache, {args.rounds} rounds")
    print(f"{'process start to first token (s)':36}{'median':>8}{'min':>8}{'max':>8}{'CPU s':>8}")
    for name, runs in starts.items():
        t = [r.wall for r in runs]
        print(f"{name:36}{statistics.median(t):8.2f}{min(t):8.2f}{max(t):8.2f}{_cpu(runs):>8}")
    for name in ("ctxpar generate", "ctxpar baseline"):
        if "llama.cpp" in starts and name in starts:
            ratio = _median(starts[name]) / _median(starts["llama.cpp"])
            print(f"{name} / llama.cpp: {ratio:.2f}x (goal <= 2x)")
    print(f"load average {os.getloadavg()[0]:.1f}")


def evict(files: list[Path]) -> None:
    """Drop ``files``' pages from the page cache (those no process maps)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class Start:
    wall: float  # seconds from the launch to the first byte
    cpu: float | None  # CPU seconds its threads had used by then; None without /proc


def _median(runs: list[Start]) -> float:
    return statistics.median(r.wall for r in runs)


def _cpu(runs: list[Start]) -> str:
    cpu = [r.cpu for r in runs if r.cpu is not None]
    return f"{statistics.median(cpu):.2f}" if cpu else "-"


def _checkout(root: str) -> Path:
    """``--baseline``'s directory, checked to hold a ctxpar package (run from there, it
    shadows the installed one: ``python -m`` puts the working directory first)."""
    d = Path(root).expanduser().resolve()
    if not (d / "ctxpar" / "cli.py").is_file():
        raise CtxparError(f"--baseline {root} holds no ctxpar/cli.py; pass the root of a ctxpar checkout")
    return d


def _first_byte(cmd: list[str], cold: list[Path], cwd: Path | None = None) -> Start:
    """``cmd`` launched (``cold`` evicted first) until the first byte of its stdout."""
    evict(cold)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)
    assert proc.stdout is not None
    got = proc.stdout.read(1)
    elapsed = time.perf_counter() - t0
    cpu = _cpu_seconds(proc.pid)
    _, err = proc.communicate()
    if not got or proc.returncode:
        raise CtxparError(f"{cmd[0]} {' '.join(cmd[1:3])} failed (exit {proc.returncode}): {err.decode()[-2000:]}")
    return Start(elapsed, cpu)


def _cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of the live process ``pid`` (all its threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15
