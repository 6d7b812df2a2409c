"""llama.cpp's own converter (convert_hf_to_gguf.py) run on tiny transformers checkpoints:
GGUF files as llama.cpp writes them, metadata and all, which nobody here wrote.

The converter comes from the llama-cpp-python sdist (its vendor/llama.cpp, with the
gguf-py and conversion package beside it), downloaded once by pip into
``$CTXPAR_TEST_CACHE`` (default ~/.cache/ctxpar-tests) and run from there, never copied
into the project. Its tokenizer step needs sentencepiece (the test extra) and refuses BPE
tokenizers it does not know, so the checkpoints carry a small SentencePiece model
trained here (``sentencepiece_model``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import io
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp holds the converter
_VENDOR = "vendor/llama.cpp/"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def _cache() -> Path:
    return Path(os.environ.get("CTXPAR_TEST_CACHE", Path.home() / ".cache" / "ctxpar-tests"))


@functools.cache
def converter() -> Path:
    """convert_hf_to_gguf.py, downloaded once; the test skips, saying why, where it cannot be."""
    root = _unpacked("", _PARTS)
    return root / _VENDOR / "convert_hf_to_gguf.py"


@functools.cache
def chat_templates() -> Path:
    """llama.cpp's models/templates: the chat templates of many model families as their
    tokenizer_config.json files ship them (its README names each source), from the same sdist."""
    return _unpacked("-templates", ("models/templates/",)) / _VENDOR / "models" / "templates"


def _unpacked(suffix: str, parts: tuple[str, ...]) -> Path:
    """The sdist's ``parts`` (under vendor/llama.cpp) in the cache, downloaded and unpacked once."""
    root = _cache() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}{suffix}"
    if root.is_dir():
        return root
    _cache().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_cache()) as tmp:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            + [f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp],
            capture_output=True,
            text=True,
        )
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if got.returncode or not sdists:
            pytest.skip(f"cannot download the llama-cpp-python sdist (llama.cpp's files): {got.stderr[-500:]}")
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(sdists[0]) as tar:
            top = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/"
            members = [m for m in tar.getmembers() if m.name.removeprefix(top + _VENDOR).startswith(parts)]
            tar.extractall(unpacked, members=members, filter="data")
        try:
            os.rename(unpacked / top, root)
        except OSError:  # another process put it there first
            if not root.is_dir():
                raise
    return root


def convert(hf_dir: Path, out: Path, outtype: str) -> Path:
    """``hf_dir`` converted by llama.cpp's converter into ``out`` at ``outtype`` (f32, q8_0, ...).
    The converter's file is kept in the test cache under what it is made of (``_conversion_key``)
    and copied from there for the same checkpoint again: each conversion starts a Python that
    imports torch, seconds apiece, and the suite's tiny checkpoints are seeded, the same each run."""
    kept = _cache() / "converted" / f"{_conversion_key(hf_dir, outtype)}.gguf"
    if not kept.is_file():
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run(
            [sys.executable, str(converter()), str(hf_dir), "--outfile", str(tmp), "--outtype", outtype],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0 and tmp.is_file(), done.stderr[-3000:]
        os.replace(tmp, kept)
    shutil.copyfile(kept, out)
    return out


def _conversion_key(hf_dir: Path, outtype: str) -> str:
    """What the converter's output depends on: the checkpoint's directory name (it names the
    model), every file in it (names and bytes), the outtype, the converter's version and the
    versions of the packages it runs on."""
    versions = [_version(p) for p in _CONVERTER_PACKAGES]
    key = hashlib.sha256(repr([hf_dir.name, outtype, LLAMA_CPP_PYTHON, *versions]).encode())
    for path in sorted(p for p in hf_dir.rglob("*") if p.is_file()):
        key.update(str(path.relative_to(hf_dir)).encode() + b"\0" + path.read_bytes())
    return key.hexdigest()[:32]


_CONVERTER_PACKAGES = ("torch", "numpy", "transformers", "tokenizers", "sentencepiece", "safetensors")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.cache
def sentencepiece_model() -> bytes:
    """A small SentencePiece BPE model (320 pieces, bytes as fallback) trained on made-up text:
    the tokenizer.model the converter reads where the checkpoint's tokenizer is SentencePiece."""
    spm = pytest.importorskip("sentencepiece", reason="the converter reads SentencePiece: pip install -e '.[test]'")
    words = "the model reads its weights from a file and every rank computes its share of the context".split()
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=out,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        num_threads=1,
        minloglevel=2,
    )
    return out.getvalue()


def gguf_of(hf_dir: Path, out_dir: Path, outtypes: tuple[str, ...]) -> dict[str, Path]:
    """{outtype: GGUF file} of the checkpoint ``hf_dir`` (weights and config.json; no tokenizer),
    converted with ``sentencepiece_model`` as its tokenizer."""
    source = out_dir / f"{hf_dir.name}-with-tokenizer"
    shutil.copytree(hf_dir, source)
    (source / "tokenizer.model").write_bytes(sentencepiece_model())
    return {t: convert(source, out_dir / f"{hf_dir.name}-{t}.gguf", t) for t in outtypes}
