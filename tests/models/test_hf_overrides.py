"""hf_overrides (vLLM's spelling): rope scaling set at load time stretches the context a
model accepts, and the model then computes what transformers computes with the same
config, past the checkpoint's trained length; two ranks equal one."""

from __future__ import annotations

import json

import pytest
import torch

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError
from ctxpar.models.loader import load_model
from helpers.reference import SingleSequence

TRAINED = 512  # the tiny models' max_position_embeddings
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
LINEAR = {"rope_scaling": {"type": "linear", "factor": 2.0}}  # the older "type" spelling


def transformers_with(d, rope: dict, max_len: int):
    """transformers' model of the checkpoint with the rope parameters written out in full."""
    from transformers import AutoConfig, AutoModelForCausalLM

    theta = AutoConfig.from_pretrained(d).rope_parameters["rope_theta"]
    return AutoModelForCausalLM.from_pretrained(
        d,
        dtype=torch.float32,
        attn_implementation="eager",
        rope_parameters={**rope, "rope_theta": theta},
        max_position_embeddings=max_len,
    ).eval()


@pytest.mark.parametrize(
    "overrides,rope,max_len",
    [
        (YARN, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED}, 4 * TRAINED),
        (LINEAR, {"rope_type": "linear", "factor": 2.0}, 2 * TRAINED),
    ],
    ids=["yarn", "linear"],
)
def test_logits_past_the_trained_length_match_transformers(tiny_model_dirs, overrides, rope, max_len):
    d = tiny_model_dirs["llama"]
    loaded = load_model(str(d), torch.float32, torch.device("cpu"), hf_overrides=overrides)
    assert loaded.max_model_len == max_len
    ids = torch.randint(0, 256, (max_len - 8,), generator=torch.Generator().manual_seed(0))
    want = transformers_with(d, rope, max_len)(ids[None]).logits[0]
    got = SingleSequence(loaded.model, max_len).step(ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    plain = load_model(str(d), torch.float32, torch.device("cpu")).model
    assert not torch.allclose(SingleSequence(plain, max_len).step(ids[:300])[-1], got[299], atol=1e-3)


def test_the_engine_accepts_the_stretched_context_only_with_the_overrides(tiny_model_dirs):
    d = str(tiny_model_dirs["llama"])
    with pytest.raises(CtxparError, match="exceeds the context length"):
        LLM(d, max_model_len=4 * TRAINED)
    with LLM(d, hf_overrides=json.dumps(YARN), max_model_len=4 * TRAINED) as llm:
        out = llm.generate([{"prompt_token_ids": [5] * (3 * TRAINED)}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.multiprocess
def test_two_ranks_equal_one_past_the_trained_length(tiny_model_dirs):
    d = str(tiny_model_dirs["llama"])
    prompt = {"prompt_token_ids": torch.randint(0, 256, (3 * TRAINED,), generator=torch.Generator()).tolist()}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = {}
    for p in (1, 2):
        with LLM(d, hf_overrides=YARN, pcp_size=p, pcp_min_tokens=0, max_num_batched_tokens=512) as llm:
            outs[p] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert outs[2].token_ids == outs[1].token_ids
    for a, b in zip(outs[1].logprobs, outs[2].logprobs):
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize(
    "bad,words",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a dict"),
        ({"rope_scaling": "yarn"}, "rope_scaling must be a dict"),
        ({"rope_scaling": {"rope_type": "no-such-rope", "factor": 2.0}}, "do not make a valid config"),
    ],
)
def test_bad_overrides_are_named(tiny_model_dirs, bad, words):
    with pytest.raises(CtxparError, match=words):
        LLM(str(tiny_model_dirs["llama"]), hf_overrides=bad)
