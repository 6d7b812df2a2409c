"""ctxpar's GGUF header reader (models/gguf_file.py) against the gguf package's
reader, on the real SmolLM2 GGUF and a file written with the package's writer:
the same metadata, array lengths, tensors, and bytes; broken files refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType

from ctxpar.bench.gguf_shapes import Shape, write_gguf
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
