"""Logits processing (penalties, logit_bias, bad_words, allowed_token_ids,
min_tokens) against a straightforward reference: transformers' logits, with
each rule applied by hand, token by token, in plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from ctxpar import LLM, SamplingParams
from helpers.tiny_tokenizer import with_byte_tokenizer

ENGINE = dict(kv_cache_bytes=1 << 24, max_model_len=96, max_num_batched_tokens=32)
PROMPT = [ord(c) for c in "the cat sat on the mat. the cat "]  # byte tokenizer: one token per byte


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory) -> str:
    return str(with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("proc") / "llama_bytes"))


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logits(
    raw: list[float],
    p: SamplingParams,
    prompt: list[int],
    out: list[int],
    bad_words: list[list[int]],
    stop_ids: list[int],
) -> list[float]:
    """vLLM's rules, written out one token at a time."""
    x = list(raw)
    v = len(x)
    for t in range(v):
        if p.allowed_token_ids is not None and t not in p.allowed_token_ids:
            x[t] = -math.inf
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) <= len(out) and out[len(out) - len(prefix) :] == prefix:
            x[word[-1]] = -math.inf
    if len(out) < p.min_tokens:
        for t in stop_ids:
            x[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in range(v):
        if t in prompt or t in out:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        count = out.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


def reference_greedy(hf, p: SamplingParams, prompt: list[int], n: int, bad_words=(), stop_ids=()) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            raw = hf(torch.tensor([prompt + out])).logits[0, -1].tolist()
        x = reference_logits(raw, p, prompt, out, list(bad_words), list(stop_ids))
        out.append(max(range(len(x)), key=x.__getitem__))
    return out


CASES = {
    "repetition": SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.8),
    "below_one_and_negative": SamplingParams(
        temperature=0, max_tokens=10, repetition_penalty=0.6, frequency_penalty=-1.0, presence_penalty=-2.0
    ),
    "frequency_presence": SamplingParams(temperature=0, max_tokens=10, frequency_penalty=1.5, presence_penalty=0.7),
    "logit_bias": SamplingParams(temperature=0, max_tokens=10, logit_bias={ord("x"): 8.0, ord("y"): 7.5, 0: -50.0}),
    "all_together": SamplingParams(
        temperature=0,
        max_tokens=10,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        logit_bias={ord("q"): 4.0},
        allowed_token_ids=[ord(c) for c in "aeiouq "],
    ),
}


@pytest.fixture(scope="module")
def plain(llm) -> list[int]:
    """The greedy tokens without any processing."""
    sp = SamplingParams(temperature=0, max_tokens=10)
    return llm.generate({"prompt_token_ids": PROMPT}, sp, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("name", list(CASES))
def test_penalties_bias_and_allowed_match_the_reference(llm, hf, plain, name):
    p = CASES[name]
    out = llm.generate({"prompt_token_ids": PROMPT}, p, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference_greedy(hf, p, PROMPT, p.max_tokens)
    assert out.token_ids != plain  # the case changes something


def test_min_tokens_bans_stop_tokens_until_reached(llm, hf):
    plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    first = plain[0].outputs[0].token_ids[0]
    # Without min_tokens the greedy first token stops the request at once.
    stopped = llm.generate(
        {"prompt_token_ids": PROMPT},
        SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    p = SamplingParams(temperature=0, max_tokens=10, min_tokens=5, stop_token_ids=[first])
    out = llm.generate({"prompt_token_ids": PROMPT}, p, use_tqdm=False)[0].outputs[0]
    want = reference_greedy(hf, p, PROMPT, 10, stop_ids=[first])
    stop_at = next((i for i, t in enumerate(want) if t == first), None)
    want = want if stop_at is None else want[: stop_at + 1]
    assert len(out.token_ids) >= 5 and first not in out.token_ids[:5]
    assert out.token_ids == want


def test_min_tokens_delays_stop_strings(llm):
    free = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[1]  # a stop string the greedy output completes at its second character
    early = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=12, stop=stop), use_tqdm=False
    )[0].outputs[0]
    late = llm.generate(
        {"prompt_token_ids": PROMPT},
        SamplingParams(temperature=0, max_tokens=12, stop=stop, min_tokens=4),
        use_tqdm=False,
    )[0].outputs[0]
    assert early.text == text[: text.index(stop)]
    i = text.index(stop, 4) if stop in text[4:] else None  # the byte tokenizer: one character per token
    assert late.text == (text if i is None else text[:i])


def test_bad_words_are_never_completed(llm, hf):
    plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = plain[0].outputs[0].text
    word = text[2:4]  # two bytes the free run generates: banned as a pair (and after a space)
    p = SamplingParams(temperature=0, max_tokens=12, bad_words=[word])
    out = llm.generate({"prompt_token_ids": PROMPT}, p, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    alone, spaced = (tok.encode(w, add_special_tokens=False) for w in (word.lstrip(), " " + word.lstrip()))
    # vLLM's rule: the spaced variant counts when it is another word token of the same length.
    banned = [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    assert out.token_ids == reference_greedy(hf, p, PROMPT, 12, bad_words=banned)
    assert word not in out.text and out.token_ids != plain[0].outputs[0].token_ids


def test_random_sampling_stays_in_allowed_and_honours_bias(llm):
    allowed = [ord(c) for c in "abc"]
    p = SamplingParams(temperature=1.5, seed=3, max_tokens=40, allowed_token_ids=allowed, logit_bias={ord("c"): -100.0})
    out = llm.generate({"prompt_token_ids": PROMPT}, p, use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= {ord("a"), ord("b")} and len(out.token_ids) == 40
