"""Every bad input raises a CtxparError that names the value and the limit,
before any work, and never disturbs the requests already in flight."""

from __future__ import annotations

import pytest

from ctxpar import LLM, CtxparError, SamplingParams


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(max_tokens=0), ["max_tokens", ">= 1", "0"]),
        (dict(max_tokens=2.5), ["max_tokens", "2.5"]),
        (dict(temperature=-0.1), ["temperature", ">= 0", "-0.1"]),
        (dict(top_p=0.0), ["top_p", "(0, 1]", "0.0"]),
        (dict(top_p=1.5), ["top_p", "(0, 1]", "1.5"]),
        (dict(top_k=0), ["top_k", "-1", "0"]),
        (dict(top_k=-2), ["top_k", "-2"]),
        (dict(min_p=-0.5), ["min_p", "[0, 1]", "-0.5"]),
        (dict(min_p=1.01), ["min_p", "[0, 1]", "1.01"]),
        (dict(logprobs=-1), ["logprobs", ">= 0", "-1"]),
        (dict(seed="x"), ["seed", "'x'"]),
        (dict(stop=[""]), ["stop"]),
        (dict(stop_token_ids=[-3]), ["stop_token_ids", "-3"]),
    ],
)
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(CtxparError) as e:
        SamplingParams(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_good_sampling_params_edges():
    p = SamplingParams(temperature=0, top_k=-1, top_p=1, min_p=1, logprobs=0, stop="x")
    assert p.greedy and p.stop_strings == ["x"] and p.stop_token_ids == []


def test_unknown_llm_argument_lists_the_valid_ones():
    with pytest.raises(CtxparError) as e:
        LLM(None, max_num_seq=4)  # typo of max_num_seqs; raised before any model is loaded
    msg = str(e.value)
    assert "max_num_seq" in msg and "max_num_seqs" in msg and "block_size" in msg


def test_bad_engine_config_and_model_path(tmp_path):
    with pytest.raises(CtxparError, match="block_size"):
        LLM(None, block_size=0)
    with pytest.raises(CtxparError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), max_model_len=64, kv_cache_bytes=1 << 22) as llm:
        yield llm


BAD_PROMPTS = [
    ({"prompt_token_ids": []}, ["empty"]),
    ({"prompt_token_ids": list(range(64))}, ["64 tokens", "max_model_len=64", "63"]),
    ({"prompt_token_ids": [1, 2, 256]}, ["256", "[0, 256)", "token 2"]),
    ({"prompt_token_ids": [-1]}, ["-1", "[0, 256)"]),
    ({"prompt_token_ids": [1, "a"]}, ["integers"]),
    ({"prompt_token_ids": [1.5]}, ["integers"]),
    ("text", ["tokenizer"]),  # the tiny model has none
    (42, ["prompt must be"]),
]


@pytest.mark.parametrize("prompt, words", BAD_PROMPTS)
def test_bad_prompt_raises_before_work(llm, prompt, words):
    steps = llm.engine.num_steps
    with pytest.raises(CtxparError) as e:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    for w in words:
        assert w in str(e.value)
    # The good prompt before it was not queued either: nothing ran.
    assert llm.engine.num_steps == steps and not llm.engine.has_unfinished_requests()


def test_long_max_tokens_is_fine_and_stops_at_max_model_len(llm):
    [out] = llm.generate({"prompt_token_ids": list(range(60))}, SamplingParams(max_tokens=1000, seed=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_params_list_must_match_prompts(llm):
    with pytest.raises(CtxparError, match="2 sampling params for 3 prompts"):
        llm.generate([{"prompt_token_ids": [1]}] * 3, [SamplingParams()] * 2, use_tqdm=False)
    with pytest.raises(CtxparError, match="SamplingParams"):
        llm.generate({"prompt_token_ids": [1]}, [{"max_tokens": 3}], use_tqdm=False)


def test_chat_without_template_raises(llm):
    with pytest.raises(CtxparError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_bad_request_leaves_requests_in_flight_intact(llm):
    prompts = [[(7 * i + k) % 256 for k in range(5 + 9 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    reference = [o.outputs[0].token_ids for o in outs]

    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results = {}
    bad = [[], list(range(64)), [300], [-5]]
    step = 0
    while engine.has_unfinished_requests():
        if step < len(bad):  # a bad request arrives mid-generation
            with pytest.raises(CtxparError):
                engine.add_request(bad[step], SamplingParams())
        if step == 0:
            with pytest.raises(CtxparError, match="already in use"):
                engine.add_request([1, 2], SamplingParams(max_tokens=3), request_id=ids[0])
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [results[i] for i in ids] == reference
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_closed_llm_raises(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen2"]), kv_cache_bytes=1 << 22)
    llm.close()
    llm.close()  # idempotent
    with pytest.raises(CtxparError, match="closed"):
        llm.generate({"prompt_token_ids": [1]})
