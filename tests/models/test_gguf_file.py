"""ctxpar's GGUF header reader (models/gguf_file.py) against the gguf package's
reader, on the real SmolLM2 GGUF and a file written with the package's writer:
the same metadata, array lengths, tensors, and bytes; broken files refused."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType

from ctxpar.bench.gguf_shapes import Shape, write_gguf
from ctxpar.kernels.huge_pages import on_huge_pages
from ctxpar.layers.linear import shared_tensors
from ctxpar.layers.quant_linear import QuantParts, QuantWeight, concat
from ctxpar.layers.weight_arena import place_on_huge_pages
from ctxpar.models.gguf import unpermute
from ctxpar.models.gguf_file import GGUFFile
from ctxpar.models.loader import default_model_path, load_model


def agrees_with_gguf(path: Path) -> None:
    ours, theirs = GGUFFile(path), GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its own header counts
    for key, field in fields.items():
        if field.types[0] == GGUFValueType.ARRAY:
            assert ours.array_lengths[key] == len(field.data), key
        else:
            assert ours.metadata[key] == field.contents(), key
    assert len(ours.metadata) + len(ours.array_lengths) == len(fields)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.kind == b.tensor_type and a.shape == tuple(int(d) for d in b.shape)
        assert np.array_equal(a.data.reshape(-1), np.asarray(b.data).view(np.uint8).reshape(-1)), a.name


def test_reads_the_real_smollm2_file_as_gguf_does() -> None:
    agrees_with_gguf(default_model_path())


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> str:
    """A 2-layer shape, written in seconds."""
    from ctxpar.bench import gguf_shapes

    monkeypatch.setitem(gguf_shapes.SHAPES, "tiny", Shape(256, 2, 4, 2, 64, 512, 10000.0, tied=False))
    return "tiny"


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K"])
def test_reads_a_written_file_as_gguf_does(fmt: str, tiny: str, tmp_path: Path) -> None:
    agrees_with_gguf(write_gguf(tiny, fmt, tmp_path / "tiny.gguf", default_model_path()))


def test_truncated_and_foreign_files_are_refused(tiny: str, tmp_path: Path) -> None:
    whole = write_gguf(tiny, "Q4_0", tmp_path / "tiny.gguf", default_model_path()).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:5000])  # inside the vocabulary
    with pytest.raises(ValueError, match="truncated"):
        GGUFFile(cut)
    cut.write_bytes(whole[:-100])  # the header whole, the last tensor cut short
    with pytest.raises(ValueError, match="outside the file"):
        GGUFFile(cut)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 1"):
        GGUFFile(old)


def test_loading_maps_the_file_and_writes_only_its_tokenizer(
    tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept quantized or dequantized, the weights come from the mapped file: the
    cache holds the config and tokenizer (a few MB), no converted weights."""
    monkeypatch.setenv("CTXPAR_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny, "Q4_0", tmp_path / "tiny.gguf", default_model_path())
    for quantization in ("gguf", None):
        loaded = load_model(str(path), torch.float32, torch.device("cpu"), 256, quantization=quantization)
        assert loaded.hf_config.num_hidden_layers == 2 and loaded.tokenizer is not None
    files = [f for f in (tmp_path / "cache").rglob("*") if f.is_file()]
    assert files and sum(f.stat().st_size for f in files) < 10 << 20
    assert not [f for f in files if f.suffix == ".safetensors"]


def cached_fraction(path: Path, start: int = 0) -> float:
    """The share of ``path``'s pages from byte ``start`` on in the page cache (mincore(2)
    over a map of its own)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    first = start // mmap.PAGESIZE
    return sum(b & 1 for b in vec.raw[first:]) / (pages - first)


def test_read_ahead_reads_the_file_into_the_page_cache(tiny: str, tmp_path: Path) -> None:
    """The tensors' pages dropped from the page cache first (the file's own, written and
    synced), then read by the OS on the advice alone: what a cold load's copies then find."""
    path = write_gguf(tiny, "Q4_0", tmp_path / "tiny.gguf", default_model_path())
    reader = GGUFFile(path)
    start = reader.tensors[0].offset
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # all but the header pages the reader maps
    if cached_fraction(path, start) > 0.1:
        pytest.skip("this file system keeps the file's pages (tmpfs)")
    reader.read_ahead(reader.tensors[0])  # READ_AHEAD past the first tensor: the whole small file
    deadline = time.monotonic() + 10
    while cached_fraction(path, start) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the advice returns at once; the reads complete meanwhile
    assert cached_fraction(path, start) == 1


def in_file_map(t: torch.Tensor, path: Path) -> bool:
    """Whether the bytes t reaches lie in this process's memory map of the file ``path``."""
    first = t.data_ptr()
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * t.element_size()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, name = line.split(maxsplit=5)
        lo, hi = (int(a, 16) for a in span.split("-"))
        if name.strip() == str(path.resolve()) and lo <= first and last < hi:
            return True
    return False


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K"])
def test_kept_blocks_are_read_in_the_files_map_or_laid_out_on_huge_pages(fmt: str, tiny: str, tmp_path: Path) -> None:
    """The loaded weights hold exactly each file tensor's weights (Q and K rows un-permuted),
    the fused ones joined. Q4_0's blocks stay where the file's map holds them, and the
    kernels read its pages, but for Q and K, copied out un-permuted onto huge pages, where
    moving the model's weights there leaves them; Q4_K's (decoded) move there then."""
    path = write_gguf(tiny, fmt, tmp_path / "tiny.gguf", default_model_path())
    model = load_model(str(path), torch.float32, torch.device("cpu"), 256, quantization="gguf").model
    file = {t.name: t for t in GGUFReader(path).tensors}
    config = model.config

    def laid_out(name: str, n_head: int | None = None) -> QuantWeight:
        cols, rows = (int(d) for d in file[name].shape)  # innermost first
        raw = np.asarray(file[name].data).view(np.uint8).reshape(rows, -1)
        return QuantWeight.from_blocks(raw if n_head is None else unpermute(raw, n_head), fmt, cols)

    got = [model.embed_tokens, model.lm_head]
    want = [laid_out("token_embd.weight"), laid_out("output.weight")]
    in_place = [True, True]  # whether the file holds a weight's rows in order (not Q's and K's)
    for i, layer in enumerate(model.decoder_layers):
        b, attn, mlp = f"blk.{i}.", layer.self_attn, layer.mlp
        q = laid_out(b + "attn_q.weight", config.num_attention_heads)
        k = laid_out(b + "attn_k.weight", config.num_key_value_heads)
        got += [attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight]
        want += [concat([q, k, laid_out(b + "attn_v.weight")]), laid_out(b + "attn_output.weight")]
        want += [
            concat([laid_out(b + "ffn_gate.weight"), laid_out(b + "ffn_up.weight")]),
            laid_out(b + "ffn_down.weight"),
        ]
        in_place += [False, True, True, True]
    for g, w, whole in zip(got, want, in_place, strict=True):
        assert (g.bits, g.group, g.zero, g.shape) == (w.bits, w.group, w.zero, w.shape)
        assert torch.equal(g.dequantize(), w.dequantize())
        parts = g.parts if isinstance(g, QuantParts) else [g]
        if fmt == "Q4_0":  # the QKV's V in place, its Q and K copied out
            where = [whole] * len(parts) if whole else [False, False, True]
            assert [p.mapped for p in parts] == where
            assert all(all(in_file_map(t, path) for t in p.tensors()) == p.mapped for p in parts)
        else:
            assert not any(p.mapped for p in parts)
    tensors = [getattr(h, a) for h, a in shared_tensors(model)]
    assert all(on_huge_pages(t) == (fmt == "Q4_0") for t in tensors)
    where = [t.data_ptr() for t in tensors]
    place_on_huge_pages(model)
    tensors = [getattr(h, a) for h, a in shared_tensors(model)]
    assert all(on_huge_pages(t) for t in tensors)
    assert ([t.data_ptr() for t in tensors] == where) == (fmt == "Q4_0")


def test_populate_reads_a_cold_tensor_before_it_returns(tiny: str, tmp_path: Path) -> None:
    """populate (libc's madvise, the interpreter free meanwhile) has every page of the
    tensors it is given read and mapped when it returns: the first step faults nothing."""
    path = write_gguf(tiny, "Q4_0", tmp_path / "tiny.gguf", default_model_path())
    reader = GGUFFile(path)
    start = reader.tensors[0].offset
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if cached_fraction(path, start) > 0.1:
        pytest.skip("this file system keeps the file's pages (tmpfs)")
    for t in reader.tensors:
        reader.populate(t)
    assert cached_fraction(path, start) == 1
