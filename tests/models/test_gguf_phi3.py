"""Phi-3 (``Phi3ForCausalLM``, GGUF ``phi3``): Q|K|V and gate|up fused in the checkpoint and in the
file, as ctxpar's Llama model fuses them, and every layer's sliding window (Phi-3-mini-4k's 2047
keys; here WINDOW, the prompt several windows long), which llama.cpp's converter writes as
``phi3.attention.sliding_window`` and llama.cpp applies as transformers does. A tiny random
checkpoint, and its GGUF files written by llama.cpp's own converter, against transformers as
tests/models/test_gguf_families.py checks the Llama family (its tolerances and comparison); two
ranks give the bits of one, P = D = 2 its tokens.

Phi-3's longrope (short and long factors: Phi-3-mini-128k, Phi-3.5-mini) is checked by
tests/models/test_longrope.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ctxpar.models.loader import _read_config
from helpers.llama_cpp import gguf_of
from tests.models.test_gguf_families import (
    COMMON,
    TIE,
    TOL,
    assert_close_at_the_top,
    assert_q8_0_file_matches_transformers,
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
    assert_q8_0_file_matches_transformers(hf, files["q8_0"])


@pytest.mark.multiprocess
def test_two_ranks_give_the_bits_of_one_and_dcp_its_tokens(phi3) -> None:
    assert_ranks_give_the_bits_of_one(str(phi3[1]["f32"]))
