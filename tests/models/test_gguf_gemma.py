"""Gemma 2 and Gemma 3 GGUF files (``gemma2``, ``gemma3``) as llama.cpp's own converter writes them
(helpers/llama_cpp.py) from tiny random checkpoints, against transformers on the checkpoint, as
tests/models/test_gguf_families.py checks the Llama family (its tolerances and comparison):

- the description read from the file is the checkpoint's: the settings the file does not state
  are llama.cpp's (Gemma 2 every other layer windowed, Gemma 3 five in six, its sliding layers'
  rope base 10000; the attention's scale 1/sqrt(head_dim)), so the checkpoints here state them;
- the norms' factors the file holds (1 + w) read back as the checkpoint's w;
- F32 and Q8_0 (with transformers' own GGUF reader of the file's weights; the blocks kept,
  int8 activations, within test_quantized_gguf.py's bounds), a 40-token prompt over a window of 16.

P = 2 and P = D = 2 are checked on the checkpoints (tests/models/test_gemma.py): the model a file
loads is the one a directory does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ctxpar.models.loader import _read_config
from helpers.llama_cpp import gguf_of
from tests.models.test_gemma import GEMMA, LINEAR, peaked
from tests.models.test_gguf_families import (
    TIE,
    TOL,
    assert_close_at_the_top,
    assert_q8_0_file_matches_transformers,
    ctxpar_logprobs,
    transformers_logprobs,
)


def configs() -> dict:
    from transformers import Gemma2Config, Gemma3TextConfig

    # query_pre_attn_scalar: head_dim, the scale llama.cpp gives every Gemma file but a 27B's.
    return {
        "gemma2": Gemma2Config(
            **GEMMA, num_hidden_layers=4, query_pre_attn_scalar=32, architectures=["Gemma2ForCausalLM"]
        ),
        "gemma3": Gemma3TextConfig(
            **GEMMA,
            num_hidden_layers=6,  # llama.cpp's pattern: five windowed layers, then a full one
            query_pre_attn_scalar=32,
            rope_scaling=LINEAR,
            architectures=["Gemma3ForCausalLM"],
        ),
    }


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """{family: (checkpoint, {outtype: GGUF file})}."""
    from helpers.models import save_tiny_model

    root = tmp_path_factory.mktemp("gguf_gemma")
    out = {}
    for name, config in configs().items():
        hf = peaked(save_tiny_model(config, root / name))
        out[name] = (hf, gguf_of(hf, root, ("f32", "q8_0")))
    return out


def test_the_files_describe_the_checkpoints(gemmas) -> None:
    from ctxpar.models.gguf import config_from_gguf, open_gguf

    for name, (hf, files) in gemmas.items():
        theirs = _read_config(hf, hf)
        assert theirs.sliding_layers == ([0, 2] if name == "gemma2" else [0, 1, 2, 3, 4])
        for path in files.values():
            ours = config_from_gguf(open_gguf(path), path)  # its eps a float32
            assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs, name


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_the_files_match_transformers(gemmas, name: str) -> None:
    hf, files = gemmas[name]
    assert_close_at_the_top(ctxpar_logprobs(files["f32"]), transformers_logprobs(hf), TOL, TIE)
    assert_q8_0_file_matches_transformers(hf, files["q8_0"])
