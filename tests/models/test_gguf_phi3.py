"""Phi-3 (``Phi3ForCausalLM``, GGUF ``phi3``): Q|K|V and gate|up fused in the checkpoint and in the
file, as ctxpar's Llama model fuses them, and every layer's sliding window (Phi-3-mini-4k's 2047
keys; here WINDOW, the prompt several windows long), which llama.cpp's converter writes as
``phi3.attention.sliding_window`` and llama.cpp applies as transformers does. A tiny random
checkpoint, and its GGUF files written by llama.cpp's own converter, against transformers as
tests/models/test_gguf_families.py checks the Llama family (its tolerances and comparison); two
ranks give the bits of one, P = D = 2 its tokens.

The longrope rope (short and long factors: Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) is refused,
from a directory and from a file, naming it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ctxpar.errors import CtxparError
from ctxpar.models.loader import _read_config, load_model
from helpers.llama_cpp import gguf_of
from tests.models.test_gguf_families import (
    COMMON,
    QUANT_GAP,
    QUANT_TOL,
    TIE,
    TOL,
    assert_close_at_the_top,
    assert_ranks_give_the_bits_of_one,
    ctxpar_logprobs,
    peaked,
    transformers_logprobs,
)

WINDOW = 12  # keys: IDS (40 tokens) spans more than three windows


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """(checkpoint, {outtype: GGUF file}), every layer windowed."""
    from transformers import Phi3Config

    from helpers.models import save_tiny_model

    root = tmp_path_factory.mktemp("gguf_phi3")
    hf = peaked(save_tiny_model(Phi3Config(**COMMON, sliding_window=WINDOW, pad_token_id=0), root / "phi3"))
    return hf, gguf_of(hf, root, ("f32", "q8_0"))


def test_the_files_describe_the_checkpoint(phi3) -> None:
    from ctxpar.models.gguf import config_from_gguf, open_gguf

    hf, files = phi3
    theirs = _read_config(hf, hf)
    assert theirs.architectures == ("Phi3ForCausalLM",)
    assert theirs.sliding_window == WINDOW and len(theirs.sliding_layers) == theirs.num_hidden_layers
    for path in files.values():
        ours = config_from_gguf(open_gguf(path), path)  # its eps a float32
        assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs


def test_the_checkpoint_and_its_files_match_transformers(phi3) -> None:
    hf, files = phi3
    want = transformers_logprobs(hf)
    assert_close_at_the_top(ctxpar_logprobs(hf), want, TOL, TIE)
    assert_close_at_the_top(ctxpar_logprobs(files["f32"]), want, TOL, TIE)
    want = transformers_logprobs(hf, files["q8_0"])
    assert_close_at_the_top(ctxpar_logprobs(files["q8_0"]), want, TOL, TIE)
    assert_close_at_the_top(ctxpar_logprobs(files["q8_0"], "gguf"), want, QUANT_TOL, QUANT_GAP)


@pytest.mark.multiprocess
def test_two_ranks_give_the_bits_of_one_and_dcp_its_tokens(phi3) -> None:
    assert_ranks_give_the_bits_of_one(str(phi3[1]["f32"]))


def test_longrope_is_refused_naming_it(phi3, tmp_path: Path) -> None:
    import gguf

    longrope = Path(shutil.copytree(phi3[0], tmp_path / "longrope"))
    config = json.loads((longrope / "config.json").read_text())
    config["rope_parameters"] = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 128,
    }
    (longrope / "config.json").write_text(json.dumps(config))
    with pytest.raises(CtxparError, match="phi3 model with the longrope rope"):
        load_model(str(longrope), torch.float32, torch.device("cpu"))
    w = gguf.GGUFWriter(str(tmp_path / "longrope.gguf"), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    for kind in ("long", "short"):
        w.add_tensor(f"rope_factors_{kind}.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CtxparError, match="scales its rope by longrope"):
        load_model(str(tmp_path / "longrope.gguf"), torch.float32, torch.device("cpu"))
