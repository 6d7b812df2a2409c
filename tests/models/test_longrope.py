"""Phi-3's longrope (Phi-3-mini-128k, Phi-3.5-mini): short and long frequency factors, from a
tiny random ``Phi3ForCausalLM`` checkpoint and its GGUF files written by llama.cpp's own converter
(which keeps the factors as rope_factors_short/long tensors), against transformers as
tests/models/test_gguf_families.py checks the Llama family (its tolerances and comparison).

ctxpar picks the factors once, by the context the model is loaded for (layers/rotary.py says why);
transformers by each forward pass's length. They agree, and are compared, where both pick the same:
a prompt within the original context with max_model_len within it (short factors), and a prompt
beyond it with a longer max_model_len (long factors). Where they differ (a short prompt in a model
loaded for a long context) ctxpar's tokens keep their bits as their sequence grows past the
original context, which transformers' do not; two ranks give the bits of one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ctxpar.models.loader import _read_config, load_model
from helpers.llama_cpp import gguf_of
from helpers.reference import SingleSequence
from tests.models.test_gguf_families import (
    COMMON,
    IDS,
    QUANT_GAP,
    QUANT_TOL,
    TIE,
    TOL,
    assert_close_at_the_top,
    assert_ranks_give_the_bits_of_one,
    peaked,
    transformers_logprobs,
)

ORIGINAL = 32  # the original context: IDS (40 tokens) outgrow it, IDS[:ORIGINAL] do not
HALF = 8  # head_dim / 2: the factors of each rope frequency
# Float32-exact factors (the file keeps float32, as transformers computes with), short and long apart.
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + i / 8 for i in range(HALF)],
    "long_factor": [1.0 + i for i in range(HALF)],
}


@pytest.fixture(scope="module")
def longrope(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """(checkpoint, {outtype: GGUF file}): a context of 512 tokens, trained at ORIGINAL."""
    from transformers import Phi3Config

    from helpers.models import save_tiny_model

    config = Phi3Config(
        **COMMON,
        sliding_window=None,
        pad_token_id=0,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters=LONGROPE,
    )
    root = tmp_path_factory.mktemp("longrope")
    hf = peaked(save_tiny_model(config, root / "phi3-longrope"))
    return hf, gguf_of(hf, root, ("f32", "q8_0"))


def logprobs(path: Path, ids: torch.Tensor, max_model_len: int | None = None, quantization: str | None = None):
    """(n, vocab) prompt logprobs of ``ids`` by ctxpar loaded for ``max_model_len`` tokens."""
    model = load_model(str(path), torch.float32, torch.device("cpu"), max_model_len, quantization=quantization).model
    return torch.log_softmax(SingleSequence(model, 64).step(ids), -1)


@torch.no_grad()
def reference(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' (n, vocab) logprobs of ``ids`` in one pass (its factors by their count)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return torch.log_softmax(ref(ids[None]).logits[0].float(), -1)


def test_the_files_describe_the_checkpoint(longrope) -> None:
    from ctxpar.models.gguf import config_from_gguf, open_gguf

    hf, files = longrope
    theirs = _read_config(hf, hf)
    assert theirs.rope.rope_type == "longrope" and theirs.rope.original_max_position_embeddings == ORIGINAL
    for path in files.values():
        ours = config_from_gguf(open_gguf(path), path)  # its eps a float32
        assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs


def test_within_the_original_context_the_short_factors_match_transformers(longrope) -> None:
    hf, files = longrope
    ids = IDS[:ORIGINAL]
    want = reference(hf, ids)
    for path in (hf, files["f32"]):
        assert_close_at_the_top(logprobs(path, ids, max_model_len=ORIGINAL), want, TOL, TIE)


def test_beyond_it_the_long_factors_match_transformers(longrope) -> None:
    hf, files = longrope
    want = reference(hf, IDS)
    assert_close_at_the_top(logprobs(hf, IDS), want, TOL, TIE)
    assert_close_at_the_top(logprobs(files["f32"], IDS), want, TOL, TIE)
    want = transformers_logprobs(hf, files["q8_0"])  # the file's own weights, by transformers' GGUF loader
    assert_close_at_the_top(logprobs(files["q8_0"], IDS), want, TOL, TIE)
    assert_close_at_the_top(logprobs(files["q8_0"], IDS, quantization="gguf"), want, QUANT_TOL, QUANT_GAP)


def test_a_tokens_bits_do_not_change_as_its_sequence_outgrows_the_original_context(longrope) -> None:
    """One table for the loaded context: a prompt's first tokens have the same logprobs alone and
    as the start of a longer prompt, `==`; transformers turns them by the short factors alone and by
    the long ones in the longer prompt (so the two differ there, and only the choice explains it)."""
    hf, files = longrope
    short, grown = logprobs(files["f32"], IDS[:16]), logprobs(files["f32"], IDS)
    assert torch.equal(short, grown[:16])
    assert not torch.allclose(reference(hf, IDS[:16]), reference(hf, IDS)[:16], atol=1e-3)
    assert not torch.allclose(short, logprobs(files["f32"], IDS[:16], max_model_len=ORIGINAL), atol=1e-3)


@pytest.mark.multiprocess
def test_two_ranks_give_the_bits_of_one_and_dcp_its_tokens(longrope) -> None:
    assert_ranks_give_the_bits_of_one(str(longrope[1]["f32"]))


def test_a_partial_rope_is_read_from_phi3_files_only(tmp_path: Path) -> None:
    """A rope over part of each head is read from a phi3 file (Phi-4-mini: tests/models/test_phi4_mini.py);
    a llama file's would turn interleaved pairs of permuted rows in llama.cpp, which ctxpar does not read."""
    import gguf
    import numpy as np

    from ctxpar.errors import CtxparError

    w = gguf.GGUFWriter(str(tmp_path / "partial.gguf"), "llama")
    w.add_block_count(1)
    w.add_vocab_size(4)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_rope_dimension_count(12)  # of a head of 16
    w.add_tensor("token_embd.weight", np.zeros((4, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CtxparError, match="turns 12 of the 16 dims of each head.*phi3 files"):
        load_model(str(tmp_path / "partial.gguf"), torch.float32, torch.device("cpu"))
