"""Every bad input raises a CtxparError that names the value and the limit,
before any work, and never disturbs the requests already in flight."""

from __future__ import annotations

import time

import pytest

from ctxpar import LLM, CtxparError, SamplingParams
from ctxpar.checks import machine_memory_bytes
from helpers.tiny_tokenizer import with_byte_tokenizer


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(max_tokens=0), ["max_tokens", ">= 1", "0"]),
        (dict(max_tokens=2.5), ["max_tokens", "2.5"]),
        (dict(temperature=-0.1), ["temperature", ">= 0", "-0.1"]),
        (dict(top_p=0.0), ["top_p", "(0, 1]", "0.0"]),
        (dict(top_p=1.5), ["top_p", "(0, 1]", "1.5"]),
        (dict(top_k=-2), ["top_k", "-2"]),
        (dict(min_p=-0.5), ["min_p", "[0, 1]", "-0.5"]),
        (dict(min_p=1.01), ["min_p", "[0, 1]", "1.01"]),
        (dict(logprobs=-2), ["logprobs", ">= 0", "-1", "-2"]),
        (dict(seed="x"), ["seed", "'x'"]),
        (dict(stop=[""]), ["stop"]),
        (dict(stop_token_ids=[-3]), ["stop_token_ids", "-3"]),
        # Non-finite floats: every float field, NaN and both infinities.
        *[
            (dict([(name, v)]), [name, "finite", repr(v)])
            for name in ("temperature", "top_p", "min_p")
            for v in (float("nan"), float("inf"), float("-inf"))
        ],
        (dict(temperature=1e-40), ["temperature", "1e-06", "1e-40"]),  # the tempered logits would overflow
        # Seeds must fit 64 bits (torch.Generator.manual_seed's range), and the message says so.
        (dict(seed=1 << 64), ["seed", "18446744073709551615", "64 bits", str(1 << 64)]),
        (dict(seed=-(1 << 63) - 1), ["seed", "-9223372036854775808", str(-(1 << 63) - 1)]),
        (dict(seed=1.0), ["seed", "1.0"]),
        # Wrong types: a clear error, not a raw TypeError from deep inside.
        (dict(stop=5), ["stop", "list of strings", "5"]),
        (dict(stop=[5]), ["stop", "5"]),
        (dict(stop={"x": 1}), ["stop", "{'x': 1}"]),
        (dict(stop_token_ids=5), ["stop_token_ids", "list", "5"]),
        (dict(stop_token_ids="12"), ["stop_token_ids", "'12'"]),
        (dict(stop_token_ids=[1.5]), ["stop_token_ids", "1.5"]),
        (dict(stop_token_ids=[True]), ["stop_token_ids", "True"]),
        # bool is an int in Python, never a count here.
        (dict(max_tokens=True), ["max_tokens", "True"]),
        (dict(top_k=True), ["top_k", "True"]),
        (dict(logprobs=False), ["logprobs", "False"]),
        (dict(seed=True), ["seed", "True"]),
        (dict(temperature=True), ["temperature", "True"]),
        (dict(ignore_eos=1), ["ignore_eos", "True or False", "1"]),
        (dict(skip_special_tokens="no"), ["skip_special_tokens", "'no'"]),
        (dict(max_tokens="8"), ["max_tokens", "'8'"]),
        (dict(temperature="0.5"), ["temperature", "'0.5'"]),
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


# -- values changed after construction are checked where the request enters --


@pytest.fixture(scope="module")
def text_llm(tiny_model_dirs, tmp_path_factory):
    path = with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("mutation") / "llama_bytes")
    with LLM(str(path), max_model_len=128, kv_cache_bytes=1 << 22) as llm:
        yield llm


def test_fields_set_after_construction_are_honoured(text_llm):
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    [ref] = text_llm.generate("Hello", SamplingParams(**greedy), use_tqdm=False)
    text = ref.outputs[0].text
    # A stop string from the reference's middle: the first occurrence of a
    # printable character that did not appear before it.
    k = next(i for i, c in enumerate(text) if i > 0 and c.isprintable() and c != "\ufffd" and text.find(c) == i)

    sp = SamplingParams(**greedy)
    sp.stop = [text[k]]  # set after construction: must not be ignored
    [out] = text_llm.generate("Hello", sp, use_tqdm=False)
    assert out.outputs[0].text == text[:k]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", text[k])

    sp = SamplingParams(**greedy)
    sp.max_tokens = 5
    [out] = text_llm.generate("Hello", sp, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids[:5]
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("max_tokens", 0, ["max_tokens", ">= 1", "0"]),
        ("max_tokens", "5", ["max_tokens", "'5'"]),
        ("stop", 5, ["stop", "5"]),
        ("stop", [""], ["stop", "''"]),
        ("stop_token_ids", 7, ["stop_token_ids", "7"]),
        ("temperature", float("nan"), ["temperature", "finite", "nan"]),
        ("top_p", float("inf"), ["top_p", "finite", "inf"]),
        ("seed", 1 << 64, ["seed", "64 bits"]),
    ],
)
def test_bad_field_set_after_construction_is_refused_before_work(text_llm, field, value, words):
    sp = SamplingParams(max_tokens=4)
    setattr(sp, field, value)
    steps = text_llm.engine.num_steps
    with pytest.raises(CtxparError) as e:
        text_llm.generate(["Hi", "Hello"], sp, use_tqdm=False)
    for w in words:
        assert w in str(e.value)
    assert text_llm.engine.num_steps == steps and not text_llm.engine.has_unfinished_requests()
    with pytest.raises(CtxparError, match=field):
        next(text_llm.stream_outputs("Hi", sp))


def test_changing_params_after_adding_does_not_reach_the_request(llm):
    prompt = [3, 1, 4, 1, 5]

    def make():
        return SamplingParams(temperature=0.9, seed=7, max_tokens=6, ignore_eos=True, stop_token_ids=[])

    [ref] = llm.generate({"prompt_token_ids": prompt}, make(), use_tqdm=False)
    engine = llm.engine
    sp = make()
    rid = engine.add_request(prompt, sp)
    # Bad or different values after the request is queued: the engine works on its own copy.
    sp.temperature, sp.max_tokens, sp.stop_token_ids, sp.stop = float("nan"), 1, 5, 5
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                done = out
    assert done is not None and done.outputs[0].token_ids == ref.outputs[0].token_ids


# -- a batch is added all or nothing --


def test_bad_seed_mid_batch_queues_nothing(llm):
    prompts = [{"prompt_token_ids": [1 + i, 2, 3]} for i in range(4)]
    good = [SamplingParams(temperature=0.7, seed=i, max_tokens=5, ignore_eos=True) for i in range(4)]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, good, use_tqdm=False)]
    bad = SamplingParams(temperature=0.7, max_tokens=5)
    bad.seed = 1 << 64  # does not fit torch's 64-bit seed: used to fail in add_request, after two were queued
    with pytest.raises(CtxparError, match="seed"):
        llm.generate(prompts, [good[0], good[1], bad, good[3]], use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    # The engine is unharmed: the same batch gives the same tokens.
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, good, use_tqdm=False)] == reference


def test_batch_add_failing_after_validation_aborts_the_added(llm, monkeypatch):
    # A failure validation cannot foresee (injected into the third add): the
    # two requests already added must be aborted, not left queued forever.
    engine = llm.engine
    real_add, calls = engine.add_request, []

    def failing_add(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected")
        return real_add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", failing_add)
    with pytest.raises(MemoryError, match="injected"):
        llm.generate([{"prompt_token_ids": [i + 1]} for i in range(4)], SamplingParams(max_tokens=3), use_tqdm=False)
    monkeypatch.undo()
    assert len(calls) == 3
    assert not engine.has_unfinished_requests() and not engine.requests and not llm._requests.mailbox
    engine.block_manager.check_integrity()
    [out] = llm.generate({"prompt_token_ids": [9]}, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


# -- the KV cache size is checked against the device before anything is allocated --


def test_huge_num_kv_blocks_fails_fast(tiny_model_dirs):
    t0 = time.perf_counter()
    with pytest.raises(CtxparError) as e:
        LLM(str(tiny_model_dirs["llama"]), num_kv_blocks=10**9)
    elapsed = time.perf_counter() - t0
    msg = str(e.value)
    assert "num_kv_blocks=1000000000" in msg and "GiB" in msg and "memory" in msg and "at most" in msg
    assert elapsed < 1.0, f"took {elapsed:.2f} s: something was built before the check"


def test_num_kv_blocks_just_beyond_memory_is_refused_before_allocating(tiny_model_dirs):
    # The tiny llama (helpers/models.py): 2 layers, 2 KV heads of 64 / 4 = 16 dims, K and V, fp32, 16 tokens a block.
    per_block = 2 * (2 * 2 * 16 * 4) * 16
    blocks = machine_memory_bytes() // per_block + 1  # its block ids fit easily; its KV tensors do not
    t0 = time.perf_counter()
    with pytest.raises(CtxparError) as e:
        LLM(str(tiny_model_dirs["llama"]), num_kv_blocks=blocks)
    assert time.perf_counter() - t0 < 5.0  # nothing of the cache's size was built first
    msg = str(e.value)
    assert f"num_kv_blocks={blocks}" in msg and f"{per_block} bytes per block" in msg
    assert f"at most {blocks - 1} blocks fit" in msg


def test_kv_cache_bytes_beyond_memory_is_refused(tiny_model_dirs):
    too_much = 2 * machine_memory_bytes()
    with pytest.raises(CtxparError) as e:
        LLM(str(tiny_model_dirs["llama"]), kv_cache_bytes=too_much)
    assert f"kv_cache_bytes={too_much}" in str(e.value) and "memory" in str(e.value)


@pytest.mark.parametrize(
    "prompts, params, words",
    [
        (42, None, ["prompts must be", "int"]),
        ({"prompt_token_ids": 5}, None, ["prompt_token_ids", "integers"]),
        ({"prompt_token_ids": None}, None, ["prompt_token_ids", "integers"]),
        ([{"prompt_token_ids": [1]}], 5, ["sampling_params", "int"]),
    ],
)
def test_wrong_argument_types_are_ctxpar_errors(llm, prompts, params, words):
    with pytest.raises(CtxparError) as e:
        llm.generate(prompts, params, use_tqdm=False)
    for w in words:
        assert w in str(e.value)
    assert not llm.engine.has_unfinished_requests()
