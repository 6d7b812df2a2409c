"""One engine's run of a workload in a process of its own: bench/compare_workload.py
under a given Python (ctxpar's, or a peer's own venv), its result read back from the
line it prints. `ctxpar bench compare` and `ctxpar bench sizes` run their engines so."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ctxpar.errors import CtxparError


def run_engine(python: str, engine: str, spec_file: str, env: dict) -> dict:
    """compare_workload.py's result of ``engine`` running the workload of ``spec_file``
    (JSON) under ``python``; CtxparError, with the end of its stderr, if the run fails."""
    script = Path(__file__).with_name("compare_workload.py")
    # -I: the script's directory is not put on sys.path, or its sibling modules
    # (ctxpar/bench/kernels.py, ...) would shadow packages of the same name that
    # the peer imports ("kernels", which transformers probes for).
    proc = subprocess.run([python, "-I", str(script), engine, spec_file], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("COMPARE_RESULT "):
            return json.loads(line[len("COMPARE_RESULT ") :])
    raise CtxparError(f"the {engine} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
