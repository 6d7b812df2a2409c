"""A Qwen-MoE GGUF at BF16 keeps its experts as the file's bf16, as a dense BF16 weight is kept.

llama.cpp's converter at ``--outtype bf16`` writes each projection's experts as one 3-D BF16
tensor; loaded into the default float32 model with ``quantization="gguf"``, every expert's gate,
up and down are bf16 panels of the file's bits (2 bytes a weight), not float32 copies (4), and
the logprobs are transformers' on the checkpoint within the rounding of weights and activations
to bf16 (tests/models/test_gguf_quant_types.py's bounds for a dense BF16 file).
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
from helpers.llama_cpp import convert
from helpers.reference import SingleSequence
from tests.models.test_gguf_families import (
    IDS,
    QUANT_GAP,
    QUANT_TOL,
    assert_close_at_the_top,
    peaked,
    transformers_logprobs,
)
from tests.models.test_gguf_moe import FAMILIES, configs, with_bpe_tokenizer


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_experts_stay_the_files_bf16(tmp_path: Path, name: str) -> None:
    from helpers.models import save_tiny_model

    hf = with_bpe_tokenizer(peaked(save_tiny_model(configs()[name], tmp_path / name)))
    path = convert(hf, tmp_path / f"{name}-bf16.gguf", "bf16")
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
