"""GGUF files whose weights are Q3_K, IQ4_NL, IQ4_XS, Q2_K or BF16, loaded end to end.

A tiny two-layer Llama (SmolLM2's tokenizer) is written with the gguf package's
writer (ctxpar/bench/gguf_shapes.py's ``write_gguf``) in each type, its blocks
random bytes whose fp16 scales give weights of std ~0.02. Loaded with
``quantization="gguf"``:

- Q2_K, Q3_K, IQ4_NL and IQ4_XS stay quantized (layers/quant_blocks.py), each
  projection and the embedding a ``QuantWeight`` of the layout the docs state
  (8-bit integers; Q3_K's scales per 16, the IQ4s' per 32; Q2_K's 2-bit integers
  as nibbles, spread a group of 16 to a block of 32 for its minimum per 16,
  layers/quant_linear.py), whose weights are exactly those of the same file loaded
  with ``quantization="none"`` (gguf's own dequantizer, float32), and whose logits
  are those of that float32 model within the int8 activations' rounding;
- BF16 loads into a bfloat16 model as the file's values, bit for bit, 2 bytes a weight;
  and, from llama.cpp's converter (``--outtype bf16``), into the default float32 model as
  well: its projections the file's bf16 bits in the bf16 kernels' panels (2 bytes a weight),
  the activations rounded to bf16 as they meet them, against transformers on the checkpoint.
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
from ctxpar.kernels import panels
from ctxpar.layers.linear import PanelWeight
from ctxpar.layers.quant_linear import QuantWeight
from ctxpar.models.loader import default_model_path, load_model
from helpers.llama_cpp import gguf_of
from helpers.reference import SingleSequence
from tests.models.test_gguf_families import IDS as FAMILY_IDS
from tests.models.test_gguf_families import (
    QUANT_GAP,
    QUANT_TOL,
    assert_close_at_the_top,
    configs,
    peaked,
    transformers_logprobs,
)

# name: (weights a block, bytes a block, the fp16 scales' byte offsets and values in units
# of 0.02 / the format's typical |scale multiplier x q|).
TYPES = {
    "Q3_K": (256, 110, {108: 1 / 41}),  # d (sc - 32) q: |sc - 32| ~18, |q| ~2.3
    "IQ4_NL": (32, 18, {0: 1 / 70}),  # d kvalue: |kvalue| ~70
    "IQ4_XS": (256, 136, {0: 1 / (18 * 70)}),  # d (ls - 32) kvalue
    "Q2_K": (256, 84, {80: 1 / 10, 82: 1.5 / 10}),  # d sc q - dmin m: dmin 1.5 d centres it
}
# (bits, group) of the kernel's layout, and a weight's resident bytes after loading.
LAYOUTS = {"Q3_K": (8, 16), "IQ4_NL": (8, 32), "IQ4_XS": (8, 32), "Q2_K": (4, 32)}
RESIDENT_BYTES = {"Q3_K": 1 + 4 / 16, "IQ4_NL": 1 + 2 / 32, "IQ4_XS": 1 + 4 / 32, "Q2_K": 1 + 8 / 16}
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


@pytest.mark.parametrize("fmt", ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
def test_kept_quantized_and_equal_to_the_float32_model(fmt: str, written) -> None:
    path = written(fmt)
    kept = load_model(str(path), torch.float32, torch.device("cpu"), 256, quantization="gguf").model
    full = load_model(str(path), torch.float32, torch.device("cpu"), 256, quantization="none").model
    for k, w in enumerate(projections(kept)):
        assert isinstance(w, QuantWeight) and (w.bits, w.group, w.spread) == (*LAYOUTS[fmt], fmt == "Q2_K"), k
        # Resident: an int8 a weight and a scale a group (IQ4_NL's its fp16 d, the others' float32);
        # Q2_K's a nibble a slot, two slots a weight, and a float32 scale and offset per 16.
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


def test_bf16_is_held_as_the_files_bf16(written) -> None:
    path = written("BF16")
    model = load_model(str(path), torch.bfloat16, torch.device("cpu"), 256, quantization="gguf").model
    embd = GGUFReader(path).tensors[0]
    want = torch.from_numpy(np.asarray(embd.data).view(np.uint8).copy()).view(torch.bfloat16).reshape(49152, 256)
    assert model.embed_tokens.dtype == torch.bfloat16
    assert torch.equal(model.embed_tokens.view(torch.int16), want.view(torch.int16))
    assert torch.isfinite(logits(model, torch.bfloat16)).all()


def test_bf16_file_stays_bf16_in_a_float32_model(tmp_path: Path) -> None:
    """A Llama 3 checkpoint converted by llama.cpp at --outtype bf16, loaded into the default
    float32 model (quantization "gguf"): every projection and the lm_head are bf16 panels of the
    file's bits (2 bytes a weight, the panels' padding aside), the embedding the file's bf16 rows;
    its logprobs are transformers' on the checkpoint within the rounding of weights and
    activations to bf16, and a prompt's rows are the same bits computed with more rows after them."""
    from helpers.models import save_tiny_model

    hf = peaked(save_tiny_model(configs()["llama3"], tmp_path / "llama3"))
    path = gguf_of(hf, tmp_path, ("bf16",))["bf16"]
    model = load_model(str(path), torch.float32, torch.device("cpu"), quantization="gguf").model
    weights = [model.lm_head_packed]
    for layer in model.decoder_layers:
        weights += [layer.self_attn.qkv_weight, layer.self_attn.o_weight, layer.mlp.gate_up_weight]
        weights.append(layer.mlp.down_weight)
    width = panels.panel_width()
    for k, w in enumerate(weights):
        assert isinstance(w, PanelWeight) and w.data.dtype == torch.bfloat16, k
        rows = -(-w.out_features // width) * width  # whole panels
        assert w.data.numel() * w.data.element_size() <= 2 * rows * (w.data.shape[1] * 2), k
    embd = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    bits = torch.from_numpy(np.asarray(embd.data).view(np.int16).copy()).reshape(model.embed_tokens.shape)
    assert model.embed_tokens.dtype == torch.bfloat16 and torch.equal(model.embed_tokens.view(torch.int16), bits)
    got = torch.log_softmax(SingleSequence(model, 64).step(FAMILY_IDS), -1)
    assert_close_at_the_top(got, transformers_logprobs(hf), QUANT_TOL, QUANT_GAP)
    first = torch.log_softmax(SingleSequence(model, 64).step(FAMILY_IDS[:25]), -1)
    assert torch.equal(first, got[:25])
