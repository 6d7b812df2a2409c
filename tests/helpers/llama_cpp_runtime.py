"""llama.cpp itself (llama-cpp-python, in a venv of its own, never a ctxpar dependency) run on a
GGUF file: its logits for fixed token ids, as a reference nobody here wrote.

The test side (``llama_cpp_logits``) runs this file as a script with the venv's interpreter,
``$CTXPAR_LLAMA_CPP_PYTHON`` (default /work/venvs/llamacpp/bin/python), and skips, naming the
variable and the install command, where there is none. The script side imports only the standard
library, numpy and llama_cpp (run isolated, ``-I``: helpers/llama_cpp.py beside it would shadow
llama_cpp): it evaluates the ids as given (no BOS added) in one batch with every
position's logits kept, and writes them as a .npy file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PYTHON_VARIABLE = "CTXPAR_LLAMA_CPP_PYTHON"
DEFAULT_PYTHON = "/work/venvs/llamacpp/bin/python"
INSTALL = "python -m venv /work/venvs/llamacpp && /work/venvs/llamacpp/bin/pip install llama-cpp-python==0.3.36"


def python() -> Path | None:
    """The interpreter that imports llama_cpp, or None where there is none."""
    path = Path(os.environ.get(PYTHON_VARIABLE, DEFAULT_PYTHON))
    if not path.is_file():
        return None
    found = subprocess.run([str(path), "-I", "-c", "import llama_cpp"], capture_output=True)
    return path if found.returncode == 0 else None


def skip_reason() -> str:
    return f"llama.cpp's Python ({PYTHON_VARIABLE}, default {DEFAULT_PYTHON}) cannot import llama_cpp: {INSTALL}"


def llama_cpp_logits(interpreter: Path, gguf_file: Path, ids: list[int], n_ctx: int):
    """(len(ids), vocab) float32 logits of ``ids`` by llama.cpp on ``gguf_file``, a context of
    ``n_ctx`` tokens (it picks longrope's factors by it, as ctxpar by max_model_len)."""
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        job = {"model": str(gguf_file), "ids": ids, "n_ctx": n_ctx, "out": str(out)}
        done = subprocess.run([str(interpreter), "-I", __file__, json.dumps(job)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return np.load(out)


def _main(job: dict) -> None:
    import llama_cpp
    import numpy as np

    n = len(job["ids"])
    model = llama_cpp.Llama(
        job["model"],
        n_ctx=job["n_ctx"],
        n_batch=n,  # one batch: every position's logits from one graph, as ctxpar's prefill
        n_ubatch=n,
        n_threads=2,
        n_threads_batch=2,
        logits_all=True,
        swa_full=True,  # the window applied by the mask alone, over a cache of every key
        type_k=llama_cpp.GGML_TYPE_F32,  # its default F16 cache rounds every key and value
        type_v=llama_cpp.GGML_TYPE_F32,
        # llama.cpp sets Phi-3's special tokens' attributes by the model's name, looking up
        # <|endoftext|>, which the test tokenizer has not; the name changes nothing else.
        kv_overrides={"general.name": "ctxpar-test"},
        verbose=False,
    )
    model.eval(job["ids"])
    np.save(job["out"], np.asarray(model.scores[:n], dtype=np.float32))


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
