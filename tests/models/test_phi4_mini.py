"""Phi-4-mini's partial rotary (``Phi3ForCausalLM`` with partial_rotary_factor 0.75): the rope turns
each head's first 3/4 (half-split pairs within that part, as transformers' Phi-3 turns
q[..., :rotary_dim]) and passes the rest, with longrope factors of rotary_dim / 2 frequencies and
tied embeddings. llama.cpp's converter writes it as a phi3 file whose rope.dimension_count is
rotary_dim. A tiny random checkpoint of that shape, and its GGUF files, against transformers as
tests/models/test_gguf_families.py checks the Llama family (its tolerances and comparison; the prompt
outgrows the original context, so both engines turn by the long factors: tests/models/test_longrope.py).
The rope of the whole head is another model: the checkpoint read so gives logprobs far off. The
compiled decode loop turns each head's first 3/4 by the forward's kernel, so its steps are the
forward's bits; two ranks give the bits of one, P = D = 2 its tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ctxpar.models.loader import _read_config, load_model
from helpers.llama_cpp import gguf_of
from helpers.reference import SingleSequence
from tests.models.test_compiled_decode import PARAMS, run
from tests.models.test_gguf_families import (
    COMMON,
    IDS,
    TIE,
    TOL,
    assert_close_at_the_top,
    assert_q8_0_file_matches_transformers,
    assert_ranks_give_the_bits_of_one,
    ctxpar_logprobs,
    transformers_logprobs,
)

PARTIAL = 0.75  # Phi-4-mini's: 96 of 128 dims; here 12 of head_dim 16
HALF = 6  # rotary_dim / 2: the longrope factors' count
ORIGINAL = 32  # the original context: IDS (40 tokens) outgrow it
SHORT = [1.0 + i / 8 for i in range(HALF)]  # float32-exact (the file keeps float32)
LONG = [1.0 + i for i in range(HALF)]
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG}


def peaked(hf_dir: Path, factor: float = 16.0) -> Path:
    """The checkpoint with its final norm's weight times ``factor``: logits spread over several nats.
    (Peaking the tied table instead, as tests/models/test_gemma.py does, makes each position's top
    token mostly its own input token, which no rope changes.)"""
    from safetensors.torch import load_file, save_file

    weights = load_file(hf_dir / "model.safetensors")
    weights["model.norm.weight"] *= factor
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    return hf_dir


@pytest.fixture(scope="module")
def phi4(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """(checkpoint, {outtype: GGUF file}): Phi-4-mini's layout at a tiny width."""
    from transformers import Phi3Config

    from helpers.models import save_tiny_model

    config = Phi3Config(
        **{**COMMON, "tie_word_embeddings": True},
        sliding_window=None,
        pad_token_id=0,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=PARTIAL,
        rope_parameters={**LONGROPE, "partial_rotary_factor": PARTIAL},
    )
    root = tmp_path_factory.mktemp("phi4_mini")
    hf = peaked(save_tiny_model(config, root / "phi4-mini"))
    return hf, gguf_of(hf, root, ("f32", "q8_0"))


def test_the_hubs_config_json_reads_the_same(phi4, tmp_path) -> None:
    """Phi-4-mini's config.json on the hub spells its rope as transformers 4 did: rope_scaling with
    "type", rope_theta and partial_rotary_factor beside it."""
    import json
    import shutil

    hf, _ = phi4
    hub = tmp_path / "hub"
    shutil.copytree(hf, hub)
    config = json.loads((hf / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_scaling"] = {
        "type": "longrope",
        "short_factor": rope["short_factor"],
        "long_factor": rope["long_factor"],
    }
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=PARTIAL)
    (hub / "config.json").write_text(json.dumps(config))
    assert _read_config(hub, hub) == _read_config(hf, hf)


def test_the_files_describe_the_checkpoint(phi4) -> None:
    from ctxpar.models.gguf import config_from_gguf, open_gguf
    from ctxpar.models.gguf_file import GGUFFile

    hf, files = phi4
    theirs = _read_config(hf, hf)
    assert theirs.rope.partial_rotary_factor == PARTIAL and theirs.rope.short_factor == tuple(SHORT)
    assert theirs.tie_word_embeddings and theirs.head_dim == 16
    for path in files.values():
        assert GGUFFile(path).metadata["phi3.rope.dimension_count"] == 2 * HALF  # the part that turns
        ours = config_from_gguf(open_gguf(path), path)  # its eps a float32
        assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs


def test_the_checkpoint_and_its_files_match_transformers(phi4) -> None:
    hf, files = phi4
    want = transformers_logprobs(hf)
    assert_close_at_the_top(ctxpar_logprobs(hf), want, TOL, TIE)
    assert_close_at_the_top(ctxpar_logprobs(files["f32"]), want, TOL, TIE)
    assert_q8_0_file_matches_transformers(hf, files["q8_0"])


def test_prefill_then_decode_match_transformers(phi4) -> None:
    """The prompt's first half prefilled, then a token at a time (each decode's rope on its own)."""
    hf, _ = phi4
    model = load_model(str(hf), torch.float32, torch.device("cpu")).model
    seq = SingleSequence(model, 64)
    first = len(IDS) // 2
    steps = [seq.step(IDS[:first])] + [seq.step(IDS[i : i + 1]) for i in range(first, len(IDS))]
    assert_close_at_the_top(torch.log_softmax(torch.cat(steps), -1), transformers_logprobs(hf), TOL, TIE)


def test_a_whole_head_rope_is_another_model(phi4) -> None:
    """The mutation: the same checkpoint with its rope over whole heads (the factors padded with 1s
    to head_dim / 2 frequencies) fails the comparison, its top token another at a quarter of the
    positions or more."""
    hf, _ = phi4
    whole = {
        **LONGROPE,
        "partial_rotary_factor": 1.0,
        "short_factor": SHORT + [1.0, 1.0],
        "long_factor": LONG + [1.0, 1.0],
    }
    model = load_model(str(hf), torch.float32, torch.device("cpu"), hf_overrides={"rope_parameters": whole}).model
    assert model.rotary.rot_dim == 16
    got = torch.log_softmax(SingleSequence(model, 64).step(IDS), -1)
    want = transformers_logprobs(hf)
    with pytest.raises(AssertionError):
        assert_close_at_the_top(got, want, TOL, TIE)
    assert (got.argmax(-1) != want.argmax(-1)).sum() >= len(IDS) // 4


def test_compiled_steps_are_the_forward_bits(phi4, monkeypatch) -> None:
    """The loop serves every decode step and turns the partial rope as the forward does (a loop
    that turned whole heads gives other logprobs)."""
    hf, _ = phi4
    eager, eager_calls, _ = run(hf, monkeypatch, dtype="float32", enforce_eager=True)
    got, calls, built = run(hf, monkeypatch, dtype="float32")
    assert eager_calls == 0 and built
    assert calls >= PARAMS.max_tokens - 1  # every step after the prefill: decodes only
    assert got == eager


@pytest.mark.multiprocess
def test_two_ranks_give_the_bits_of_one_and_dcp_its_tokens(phi4) -> None:
    assert_ranks_give_the_bits_of_one(str(phi4[1]["f32"]))
