"""vLLM's SamplingParams and output semantics: n and best_of (sharing the
prompt's KV blocks), Logprob objects and cumulative_logprob, stop-string
options, truncation, max_tokens=None, logprobs=-1 and max_logprobs, fields
set after construction, and refusals that name the field."""

from __future__ import annotations

import math

import pytest

from ctxpar import LLM, CtxparError, SamplingParams
from ctxpar.logprobs import Logprob
from helpers.tiny_tokenizer import with_byte_tokenizer

MAX_MODEL_LEN = 48
ENGINE = dict(kv_cache_bytes=1 << 24, max_model_len=MAX_MODEL_LEN, block_size=4)
PROMPT = {"prompt_token_ids": [ord(c) for c in "Once upon a time, there "]}  # 24 tokens: 6 full blocks


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory) -> str:
    return str(with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("api") / "llama_bytes"))


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, **ENGINE) as llm:
        yield llm


def gen(llm, sp, prompt=PROMPT):
    return llm.generate(prompt, sp, use_tqdm=False)[0]


def test_n_samples_are_the_seeded_single_samples_and_share_the_prompt(llm):
    stats = llm.engine.scheduler.prefix_cache_stats
    hits = stats.hits
    out = gen(llm, SamplingParams(n=3, seed=11, max_tokens=6, temperature=1.0))
    # The first sample computes the prompt; the other two reuse its 5 full blocks
    # (all but the last token, which each recomputes to sample).
    assert stats.hits - hits == 2 * 20
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    for i, c in enumerate(out.outputs):
        alone = gen(llm, SamplingParams(seed=11 + i, max_tokens=6, temperature=1.0)).outputs[0]
        assert c.token_ids == alone.token_ids and c.text == alone.text
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    unseeded = gen(llm, SamplingParams(n=3, max_tokens=6))
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) == 3


def test_best_of_returns_the_n_most_likely_samples(llm):
    out = gen(llm, SamplingParams(n=2, best_of=4, seed=5, max_tokens=5))
    singles = [gen(llm, SamplingParams(seed=5 + i, max_tokens=5, logprobs=0)).outputs[0] for i in range(4)]
    ranked = sorted(singles, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked]
    for got, want in zip(out.outputs, ranked):
        assert math.isclose(got.cumulative_logprob, want.cumulative_logprob, abs_tol=1e-4)


def test_logprob_objects_and_cumulative_logprob(llm):
    tok = llm.get_tokenizer()
    c = gen(llm, SamplingParams(seed=2, max_tokens=6, logprobs=3)).outputs[0]
    assert len(c.logprobs) == 6
    total = 0.0
    for t, lps in zip(c.token_ids, c.logprobs):
        assert next(iter(lps)) == t and all(isinstance(v, Logprob) for v in lps.values())  # sampled first
        top = sorted(lps.values(), key=lambda v: -v.logprob)
        assert [v.rank for v in top[:3]] == [1, 2, 3] and lps[t].rank >= 1
        for k, v in lps.items():
            assert v.decoded_token == tok.decode([k])
        total += lps[t].logprob
    assert math.isclose(c.cumulative_logprob, total, abs_tol=1e-6)
    assert gen(llm, SamplingParams(seed=2, max_tokens=6)).outputs[0].cumulative_logprob is None
    assert c.finished() and gen(llm, SamplingParams(max_tokens=1)).prompt_logprobs is None


def test_logprobs_minus_one_and_max_logprobs(llm, model_dir):
    with pytest.raises(CtxparError, match=r"logprobs=21 .*max_logprobs=20"):
        gen(llm, SamplingParams(max_tokens=2, logprobs=21))
    with pytest.raises(CtxparError, match=r"logprobs=-1 asks for 256 .*max_logprobs=20"):
        gen(llm, SamplingParams(max_tokens=2, logprobs=-1))
    with pytest.raises(CtxparError, match=r"prompt_logprobs=30"):
        gen(llm, SamplingParams(max_tokens=2, prompt_logprobs=30))
    with LLM(model_dir, max_logprobs=-1, **ENGINE) as wide:
        c = gen(wide, SamplingParams(max_tokens=2, logprobs=-1, temperature=0)).outputs[0]
        assert all(len(lps) == 256 for lps in c.logprobs)
        assert sorted(v.rank for v in c.logprobs[0].values()) == list(range(1, 257))
        assert math.isclose(sum(math.exp(v.logprob) for v in c.logprobs[0].values()), 1, abs_tol=1e-4)
    with pytest.raises(CtxparError, match="max_logprobs"):
        LLM(model_dir, max_logprobs=-2)


def test_stop_string_options_detokenize_and_spaces(llm):
    free = gen(llm, SamplingParams(temperature=0, max_tokens=16)).outputs[0]
    stop = free.text[3:5]
    i = free.text.index(stop)
    cut = gen(llm, SamplingParams(temperature=0, max_tokens=16, stop=stop)).outputs[0]
    kept = gen(llm, SamplingParams(temperature=0, max_tokens=16, stop=stop, include_stop_str_in_output=True))
    assert cut.text == free.text[:i] and kept.outputs[0].text == free.text[: i + len(stop)]
    assert kept.outputs[0].stop_reason == stop and kept.outputs[0].finish_reason == "stop"
    raw = gen(llm, SamplingParams(temperature=0, max_tokens=16, detokenize=False, logprobs=1)).outputs[0]
    assert raw.text == "" and raw.token_ids == free.token_ids
    assert all(v.decoded_token is None for lps in raw.logprobs for v in lps.values())
    spaced = gen(llm, SamplingParams(temperature=0, max_tokens=16, spaces_between_special_tokens=False)).outputs[0]
    assert spaced.text == free.text  # no special tokens here: the same text


def test_truncate_prompt_tokens_and_max_tokens_none(llm):
    ids = PROMPT["prompt_token_ids"]
    a = gen(llm, SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=7))
    b = gen(llm, SamplingParams(temperature=0, max_tokens=5), {"prompt_token_ids": ids[-7:]})
    assert a.prompt_token_ids == ids[-7:] and a.outputs[0].token_ids == b.outputs[0].token_ids
    long = {"prompt_token_ids": ids * 3}  # 72 tokens: more than max_model_len
    with pytest.raises(CtxparError, match="truncate_prompt_tokens"):
        gen(llm, SamplingParams(max_tokens=2), long)
    c = gen(llm, SamplingParams(max_tokens=2, truncate_prompt_tokens=-1), long)
    assert len(c.prompt_token_ids) == MAX_MODEL_LEN - 1
    d = gen(llm, SamplingParams(max_tokens=None, ignore_eos=True, seed=0)).outputs[0]
    assert len(d.token_ids) == MAX_MODEL_LEN - len(ids) and d.finish_reason == "length"


def test_fields_set_after_construction_are_honoured_and_checked(llm):
    free = gen(llm, SamplingParams(temperature=0, max_tokens=12)).outputs[0]
    sp = SamplingParams(temperature=0, max_tokens=12)
    sp.stop = [free.text[4:6]]
    assert gen(llm, sp).outputs[0].text == free.text[: free.text.index(free.text[4:6])]
    sp.stop = None
    sp.max_tokens = None
    assert len(gen(llm, sp).outputs[0].token_ids) == MAX_MODEL_LEN - 24
    sp.max_tokens = 0
    with pytest.raises(CtxparError, match="max_tokens must be an integer >= 1"):
        gen(llm, sp)
    sp.max_tokens, sp.n, sp.seed, sp.temperature = 3, 2, 9, 1.0
    assert len(gen(llm, sp).outputs) == 2
    sp.min_tokens = 5
    with pytest.raises(CtxparError, match="min_tokens must be <= max_tokens=3"):
        gen(llm, sp)
    sp.min_tokens, sp.include_stop_str_in_output, sp.stop = 0, True, free.text[4:6]
    sp.n, sp.temperature, sp.max_tokens = 1, 0, 12
    assert gen(llm, sp).outputs[0].text == free.text[: free.text.index(free.text[4:6]) + 2]
    # The engine keeps its own copy: changing the caller's dict later reaches no request.
    sp = SamplingParams(temperature=0, max_tokens=4, logit_bias={ord("z"): 100.0})
    rid = llm.engine.add_request(PROMPT["prompt_token_ids"], sp)
    sp.logit_bias[ord("z")] = -100.0
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += [o for o in llm.engine.step() if o.request_id == rid and o.finished]
    assert outs[0].outputs[0].token_ids == [ord("z")] * 4


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(n=0), ["n", "[1, 1024]", "0"]),
        (dict(n=2, best_of=1), ["best_of", "n=2", "1"]),
        (dict(n=2, temperature=0), ["n=2", "greedy", "temperature > 0"]),
        (dict(best_of=3, temperature=0), ["best_of=3", "greedy"]),
        (dict(presence_penalty=2.5), ["presence_penalty", "[-2, 2]", "2.5"]),
        (dict(frequency_penalty=float("nan")), ["frequency_penalty", "finite", "nan"]),
        (dict(repetition_penalty=0.0), ["repetition_penalty", "> 0", "0.0"]),
        (dict(repetition_penalty=float("inf")), ["repetition_penalty", "finite", "inf"]),
        (dict(min_tokens=-1), ["min_tokens", ">= 0", "-1"]),
        (dict(min_tokens=20, max_tokens=4), ["min_tokens", "max_tokens=4", "20"]),
        (dict(logit_bias={1: float("inf")}), ["logit_bias[1]", "finite", "inf"]),
        (dict(logit_bias={"5": 1.0}), ["logit_bias", "'5'"]),
        (dict(logit_bias=[1]), ["logit_bias", "dict"]),
        (dict(allowed_token_ids=[]), ["allowed_token_ids", "at least one"]),
        (dict(allowed_token_ids=[-1]), ["allowed_token_ids", "-1"]),
        (dict(bad_words=[""]), ["bad_words", "''"]),
        (dict(bad_words=["  "]), ["bad_words", "spaces", "'  '"]),
        (dict(prompt_logprobs=-2), ["prompt_logprobs", "-1", "-2"]),
        (dict(truncate_prompt_tokens=0), ["truncate_prompt_tokens", ">= 1", "-1", "0"]),
        (dict(stop="x", detokenize=False), ["stop", "detokenize"]),
        (dict(detokenize=1), ["detokenize", "True or False"]),
        (dict(top_k=-2), ["top_k", "-2"]),
    ],
)
def test_bad_values_are_refused_by_name(kwargs, words):
    with pytest.raises(CtxparError) as e:
        SamplingParams(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_model_limits_are_refused_at_add(llm):
    for sp, words in [
        (SamplingParams(allowed_token_ids=[300]), ["allowed_token_ids", "300", "256"]),
        (SamplingParams(logit_bias={999: 1.0}), ["logit_bias", "999", "256"]),
    ]:
        with pytest.raises(CtxparError) as e:
            gen(llm, sp)
        assert all(w in str(e.value) for w in words)
    assert not llm.engine.has_unfinished_requests()


def test_defaults_follow_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.top_k, sp.max_tokens, sp.min_tokens, sp.repetition_penalty) == (1, 0, 16, 0, 1.0)
    assert sp.detokenize and sp.spaces_between_special_tokens and not sp.include_stop_str_in_output
    assert SamplingParams(top_k=-1).top_k == -1  # still accepted as "off"
