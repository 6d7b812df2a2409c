"""A Qwen-MoE GGUF at BF16 keeps its experts as the file's bf16, as a dense BF16 weight is kept,
and the compiled decode loop runs BF16 weights with the forward's bits.

llama.cpp's converter at ``--outtype bf16`` writes each projection's experts as one 3-D BF16
tensor; loaded into the default float32 model with ``quantization="gguf"``, every expert's gate,
up and down are bf16 panels of the file's bits (2 bytes a weight), not float32 copies (4), and
the logprobs are transformers' on the checkpoint within the rounding of weights and activations
to bf16 (tests/models/test_gguf_quant_types.py's bounds for a dense BF16 file). The decode steps
of such a file, experts or a dense Llama 3, are the same floats from the compiled loop
(kernels/decode_loop.cpp: activations rounded to bf16 as layers/linear.py rounds them) and from
the forward (tests/models/test_compiled_moe_decode.py's comparison).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ctxpar.layers.linear import PanelWeight
from ctxpar.layers.moe import MoE
from ctxpar.models.gguf_file import GGUFFile
from ctxpar.models.loader import load_model
from helpers.llama_cpp import convert, gguf_of
from helpers.reference import SingleSequence
from tests.models.test_compiled_moe_decode import eager_and_compiled
from tests.models.test_gguf_families import (
    IDS,
    QUANT_GAP,
    QUANT_TOL,
    assert_close_at_the_top,
    peaked,
    transformers_logprobs,
)
from tests.models.test_gguf_families import configs as dense_configs
from tests.models.test_gguf_moe import configs, with_bpe_tokenizer


@pytest.fixture(scope="module")
def bf16_files(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{family: (checkpoint, its BF16 GGUF)} of Qwen3-MoE (the experts' 3-D tensors are read alike
    in every MoE family) and a dense Llama 3."""
    from helpers.models import save_tiny_model

    root = tmp_path_factory.mktemp("bf16")
    out = {}
    hf = with_bpe_tokenizer(peaked(save_tiny_model(configs()["qwen3moe"], root / "qwen3moe")))
    out["qwen3moe"] = (hf, convert(hf, root / "qwen3moe-bf16.gguf", "bf16"))
    hf = peaked(save_tiny_model(dense_configs()["llama3"], root / "llama3"))
    out["llama3"] = (hf, gguf_of(hf, root, ("bf16",))["bf16"])
    return out


def test_bf16_experts_stay_the_files_bf16(bf16_files) -> None:
    hf, path = bf16_files["qwen3moe"]
    model = load_model(str(path), torch.float32, torch.device("cpu"), quantization="gguf").model
    moe = model.decoder_layers[0].mlp
    assert isinstance(moe, MoE)
    downs = next(t for t in GGUFFile(path).tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert downs.kind.name == "BF16"
    bits = torch.from_numpy(np.asarray(downs.data).view(np.int16).copy()).view(torch.bfloat16)
    hidden, inter = model.config.hidden_size, model.config.moe_intermediate_size
    for e, expert in enumerate(moe.experts):
        for proj in (expert.gate_proj, expert.up_proj, expert.down_proj):
            assert isinstance(proj.weight, PanelWeight) and proj.weight.data.dtype == torch.bfloat16
        down = expert.down_proj.weight  # panels (out / NP, in / 2, NP, 2): back to (out, in)
        rows = down.data.permute(0, 2, 1, 3).reshape(-1, down.data.shape[1] * 2)[:hidden, :inter]
        assert torch.equal(rows.view(torch.int16), bits.reshape(-1, hidden, inter)[e].view(torch.int16)), e
    got = torch.log_softmax(SingleSequence(model, 64).step(IDS), -1)
    assert_close_at_the_top(got, transformers_logprobs(hf), QUANT_TOL, QUANT_GAP)


@pytest.mark.parametrize("name", ["qwen3moe", "llama3"])
def test_compiled_bf16_steps_are_the_forward_bits(bf16_files, monkeypatch, name: str) -> None:
    eager, compiled = eager_and_compiled(bf16_files[name][1], monkeypatch, quantization="gguf")
    assert compiled == eager
