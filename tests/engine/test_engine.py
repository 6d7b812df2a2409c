"""End to end on the tiny random models: batching, chunked prefill and
preemption never change a request's tokens, greedy output equals
transformers' generate, and stop conditions, logprobs and text behave."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxpar import LLM, SamplingParams
from helpers.reference import transformers_greedy
from helpers.tiny_tokenizer import with_byte_tokenizer
from helpers.workloads import SMALL, token_ids, workload


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), **SMALL) as llm:
        yield llm


@pytest.fixture(scope="module")
def alone(llama):
    """Each request of the workload generated on its own."""
    prompts, params = workload()
    return [llama.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


def test_batched_equals_alone(llama, alone):
    prompts, params = workload()
    outs = llama.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]  # input order
    assert token_ids(outs) == alone
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert all(len(o.outputs[0].token_ids) == sp.max_tokens for o, sp in zip(outs, params))
    assert all(o.finished and o.metrics.ttft is not None and o.metrics.ttft > 0 for o in outs)
    assert llama.engine.block_manager.num_free_blocks == llama.engine.num_blocks


def test_small_chunked_prefill_budget_equals_alone(tiny_model_dirs, alone):
    prompts, params = workload()
    with LLM(str(tiny_model_dirs["llama"]), max_num_batched_tokens=16, max_num_seqs=4, **SMALL) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == alone


def test_preemption_under_a_small_kv_cache_equals_alone(tiny_model_dirs, alone):
    prompts, params = workload()
    # 30 blocks of 4 = 120 slots: one full-length request fits, the workload does not.
    with LLM(str(tiny_model_dirs["llama"]), max_model_len=120, block_size=4, num_kv_blocks=30) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert token_ids(outs) == alone
        llm.engine.block_manager.check_integrity()
        assert llm.engine.block_manager.num_free_blocks == 30


def test_requests_join_between_steps(llama, alone):
    """Requests added while others are mid-generation get the same tokens."""
    prompts, params = workload()
    engine = llama.engine
    ids, results = {}, {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        ids[engine.add_request(p["prompt_token_ids"], sp)] = i
        for out in engine.step():  # one step between arrivals
            if out.finished:
                results[ids[out.request_id]] = out.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out.outputs[0].token_ids
    assert [results[i] for i in range(len(prompts))] == alone


@pytest.mark.parametrize("name", ["llama", "llama3_rope", "qwen2", "qwen3"])
def test_greedy_matches_transformers(tiny_model_dirs, name):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs[name]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 17, 40, 71)]
    with LLM(str(path), **SMALL) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
            use_tqdm=False,
        )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == transformers_greedy(hf, prompt, 32), (name, len(prompt))


def test_logprobs_match_transformers(tiny_model_dirs, llama):
    from transformers import AutoModelForCausalLM

    prompt = list(range(10, 40))
    out = llama.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0.7, seed=3, max_tokens=8, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)  # position predicting each output token
    assert len(out.logprobs) == 8
    for k, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok in lp and set(ref[k].topk(3).indices.tolist()) <= set(lp)
        for t, v in lp.items():
            assert abs(v.logprob - ref[k, t].item()) < 1e-4


def test_max_model_len_stops_with_length(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["qwen2"]), max_model_len=16, **SMALL) as llm:
        sp = SamplingParams(max_tokens=100, seed=0)
        out = llm.generate({"prompt_token_ids": list(range(10))}, sp, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].finish_reason == "length"


def test_stop_token_ids_and_eos(llama):
    prompt = {"prompt_token_ids": list(range(5, 25))}
    full = llama.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    toks = full.outputs[0].token_ids
    stop = toks[5]
    first = toks.index(stop)
    out = llama.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop]), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids == toks[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop
    saved = llama.engine.eos_token_ids
    try:
        llama.engine.eos_token_ids = {stop}
        c = llama.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == toks[: first + 1] and c.finish_reason == "stop"
        c = llama.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
        assert c.outputs[0].token_ids == toks
    finally:
        llama.engine.eos_token_ids = saved


@pytest.fixture(scope="module")
def text_llm(tiny_model_dirs, tmp_path_factory):
    d = with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("tok") / "llama_bytes")
    with LLM(str(d), **SMALL) as llm:
        yield llm


def test_text_equals_decode_and_stream_concatenates(text_llm):
    tok = text_llm.get_tokenizer()
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=40)
    out = text_llm.generate(["Hello, world", "a"], sp, use_tqdm=False)
    for o in out:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)
    assert out[0].prompt == "Hello, world" and out[0].prompt_token_ids == tok.encode("Hello, world")
    pieces = list(text_llm.stream("Hello, world", sp))
    assert len(pieces) > 1 and "".join(pieces) == out[0].outputs[0].text


def test_stop_string_truncates_text(text_llm):
    full = text_llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[6:8]  # a string known to occur
    first = text.index(stop)
    sp = SamplingParams(temperature=0, max_tokens=30, stop=[stop, "never-occurs"])
    c = text_llm.generate(["abc"], sp, use_tqdm=False)[0].outputs[0]
    assert c.text == text[:first] and c.finish_reason == "stop" and c.stop_reason == stop
    assert len(c.token_ids) < 30 and full.token_ids[: len(c.token_ids)] == c.token_ids
    streamed = "".join(text_llm.stream("abc", sp))
    assert streamed == text[:first]  # the stop string never leaks into the stream


def test_chat_renders_the_template(text_llm):
    conv = [{"role": "user", "content": "hi"}]
    sp = SamplingParams(temperature=0, max_tokens=4)
    [a] = text_llm.chat(conv, sp, use_tqdm=False)
    assert a.prompt == "<user>hi\n<assistant>"
    [b] = text_llm.generate("<user>hi\n<assistant>", sp, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(text_llm.chat([conv, conv], sp, use_tqdm=False)) == 2


def test_unseeded_sampling_is_reproducible_per_engine_seed(tiny_model_dirs):
    prompts = [{"prompt_token_ids": [1, 2, 3]}] * 2
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = []
    for seed in (7, 7, 8):
        with LLM(str(tiny_model_dirs["qwen3"]), seed=seed, **SMALL) as llm:
            runs.append(token_ids(llm.generate(prompts, sp, use_tqdm=False)))
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]  # two requests: two streams
    assert runs[2] != runs[0] and runs[2][0] != runs[0][0]  # the engine seed is used


def test_interleaved_streams_and_generate_share_the_engine(text_llm):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = [o.outputs[0].text for o in text_llm.generate(["one", "two", "three"], sp, use_tqdm=False)]
    a, b = text_llm.stream("one", sp), text_llm.stream("two", sp)
    got_a, got_b = [next(a)], [next(b)]
    # A generate() call while both streams are open steps their requests too.
    [mid] = text_llm.generate(["three"], sp, use_tqdm=False)
    got_a += list(a)
    got_b += list(b)
    assert ["".join(got_a), "".join(got_b), mid.outputs[0].text] == ref
    # A stream dropped half-way is aborted and frees its blocks.
    c = text_llm.stream("four", sp)
    next(c)
    c.close()
    engine = text_llm.engine
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == engine.num_blocks
