"""GGUF files whose weights are Q3_K, IQ4_NL, IQ4_XS, Q2_K or BF16, loaded end to end.

A tiny two-layer Llama (SmolLM2's tokenizer) is written with the gguf package's
writer (ctxpar/bench/gguf_shapes.py's ``write_gguf``) in each type, its blocks
random bytes whose fp16 scales give weights of std ~0.02. Loaded with
``quantization="gguf"``:

- Q3_K, IQ4_NL and IQ4_XS stay quantized (layers/quant_blocks.py), each
  projection and the embedding a ``QuantWeight`` of the layout the docs state
  (8-bit integers; Q3_K's scales per 16, the IQ4s' per 32), whose weights are
  exactly those of the same file loaded with ``quantization="none"`` (gguf's
  own dequantizer, float32), and whose logits are those of that float32 model
  within the int8 activations' rounding;
- Q2_K, whose minimum per 16 weights no kernel layout holds, is dequantized to
  float32 exactly (gguf's floats);
- BF16 loads into a bfloat16 model as the file's values, bit for bit, 2 bytes a weight.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from ctxpar.bench import gguf_shapes
from ctxpar.bench.gguf_shapes import Shape, write_gguf
from ctxpar.layers.quant_linear import QuantWeight
from ctxpar.models.gguf import gguf_weights, hf_name, open_gguf
from ctxpar.models.gguf_config import config_from_gguf
from ctxpar.models.loader import default_model_path, load_model
from helpers.reference import SingleSequence

# name: (weights a block, bytes a block, the fp16 scales' byte offsets and values in units
# of 0.02 / the format's typical |scale multiplier x q|).
TYPES = {
    "Q3_K": (256, 110, {108: 1 / 41}),  # d (sc - 32) q: |sc - 32| ~18, |q| ~2.3
    "IQ4_NL": (32, 18, {0: 1 / 70}),  # d kvalue: |kvalue| ~70
    "IQ4_XS": (256, 136, {0: 1 / (18 * 70)}),  # d (ls - 32) kvalue
    "Q2_K": (256, 84, {80: 1 / 10, 82: 1.5 / 10}),  # d sc q - dmin m: dmin 1.5 d centres it
}
RESIDENT_BYTES = {"Q3_K": 1 + 4 / 16, "IQ4_NL": 1 + 2 / 32, "IQ4_XS": 1 + 4 / 32}  # a weight's, after loading
SHAPE = Shape(256, 2, 4, 2, 64, 512, 10000.0, tied=False)


def blocks_of(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes a row) uint8: random integers, fp16 scales giving weights of std ~0.02."""
    if fmt == "BF16":
        w = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32) * 0.02).bfloat16()
        return w.view(torch.uint8).numpy()
    block, nbytes, scales = TYPES[fmt]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    for at, value in scales.items():
        halves = np.full(raw.shape[:2], 0.02 * value, np.float16)
        raw[:, :, at : at + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """write(fmt) -> a tiny GGUF of SHAPE in block type fmt (the writer's formats extended)."""
    monkeypatch.setitem(gguf_shapes.SHAPES, "tiny", SHAPE)
    monkeypatch.setattr(gguf_shapes, "random_blocks", blocks_of)
    for fmt, (block, nbytes, _) in {**TYPES, "BF16": (1, 2, {})}.items():
        monkeypatch.setitem(gguf_shapes.FORMATS, fmt, (block, nbytes))
    return lambda fmt: write_gguf("tiny", fmt, tmp_path / f"tiny-{fmt}.gguf", default_model_path())


def projections(model) -> list:
    """Every projection weight and the embedding tables, in a fixed order."""
    out = [model.embed_tokens, model.lm_head]
    for layer in model.decoder_layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight]
    return out


IDS = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(0))


def logits(model, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    seq = SingleSequence(model, 32, dtype)
    return torch.cat([seq.step(IDS[:20]), seq.step(IDS[20:21]), seq.step(IDS[21:22])]).float()


@pytest.mark.parametrize("fmt", ["Q3_K", "IQ4_NL", "IQ4_XS"])
def test_kept_quantized_and_equal_to_the_float32_model(fmt: str, written) -> None:
    path = written(fmt)
    kept = load_model(str(path), torch.float32, torch.device("cpu"), 256, quantization="gguf").model
    full = load_model(str(path), torch.float32, torch.device("cpu"), 256, quantization="none").model
    group = 16 if fmt == "Q3_K" else 32
    for k, w in enumerate(projections(kept)):
        assert isinstance(w, QuantWeight) and (w.bits, w.group, w.zero) == (8, group, 0), (k, type(w))
        # Resident: an int8 a weight and a scale a group (IQ4_NL's its fp16 d, the others' float32).
        assert w.nbytes() == w.shape[0] * w.shape[1] * RESIDENT_BYTES[fmt], (k, w.nbytes())
    # The embedding: its rows, exactly gguf's floats (the file's first tensor, token_embd).
    embd = GGUFReader(path).tensors[0]
    want = gguf_dequantize(np.asarray(embd.data), GGMLQuantizationType[fmt]).reshape(49152, 256)
    assert torch.equal(kept.embed_tokens.dequantize(), torch.from_numpy(want))
    assert torch.equal(full.embed_tokens, torch.from_numpy(want))
    assert torch.equal(kept.lm_head.dequantize(), full.lm_head)
    got, ref = logits(kept), logits(full)
    # int8 activations (a relative step of 1/254 a block) move the logits by a few percent of their scale.
    scale = ref.abs().max()
    assert scale > 0 and (got - ref).abs().max() <= 0.03 * scale, ((got - ref).abs().max(), scale)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_q2_k_is_dequantized_exactly(written) -> None:
    """Every Q2_K tensor, read to be kept quantized, comes as gguf's float32 weights."""
    path = written("Q2_K")
    reader = open_gguf(path)
    theirs = {t.name: t for t in GGUFReader(path).tensors}
    got = dict(gguf_weights(reader, config_from_gguf(reader, path), path, keep_quantized=True))
    for name in ("token_embd.weight", "output.weight", "blk.1.ffn_down.weight", "blk.0.attn_v.weight"):
        t = theirs[name]
        want = gguf_dequantize(np.asarray(t.data), GGMLQuantizationType.Q2_K).reshape(*reversed(t.shape.tolist()))
        w = got[hf_name(name) or ""]
        assert isinstance(w, torch.Tensor) and w.dtype == torch.float32 and torch.equal(w, torch.from_numpy(want))


def test_bf16_is_held_as_the_files_bf16(written) -> None:
    path = written("BF16")
    model = load_model(str(path), torch.bfloat16, torch.device("cpu"), 256, quantization="gguf").model
    embd = GGUFReader(path).tensors[0]
    want = torch.from_numpy(np.asarray(embd.data).view(np.uint8).copy()).view(torch.bfloat16).reshape(49152, 256)
    assert model.embed_tokens.dtype == torch.bfloat16
    assert torch.equal(model.embed_tokens.view(torch.int16), want.view(torch.int16))
    assert torch.isfinite(logits(model, torch.bfloat16)).all()
