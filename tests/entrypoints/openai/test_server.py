"""`ctxpar serve` on a tiny model, through the official openai client.

One server process for the module (started on a free loopback port, with an
API key from CTXPAR_API_KEY); references come from LLM.generate in this
process on the same checkpoint.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from ctxpar import LLM, SamplingParams
from helpers.server_harness import STOPPED, Server
from helpers.tiny_tokenizer import with_byte_tokenizer

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

KEY = "test-key"
NAME = "tiny"
PROMPTS = [f"request {i}: the quick brown fox" + " jumps" * (i % 5) for i in range(64)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    return with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("serve") / "llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    args = ["--model", str(model_dir), "--served-model-name", NAME, "--threads", "1", "--kv-cache-blocks", "512"]
    s = Server(args, api_key=KEY, log=tmp_path_factory.mktemp("serve_log") / "server.log")
    yield s
    assert s.stop() in STOPPED, s.log()
    assert "Traceback" not in s.log()


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), num_threads=1) as llm:
        yield llm


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def alone(llm, prompt, n: int) -> list[int]:
    """The reference: the prompt's greedy tokens when it is the only request."""
    [out] = llm.generate([prompt], greedy(n), use_tqdm=False)
    return out.outputs[0].token_ids


def metrics(server) -> dict[str, float]:
    return server.metrics()


def test_models(server):
    [card] = server.openai().models.list().data
    assert card.id == NAME and card.max_model_len == 512


def test_completions_equal_llm_generate(server, llm):
    client = server.openai()
    # A string, a list of strings and token ids: each choice equals LLM.generate alone.
    r = client.completions.create(
        model=NAME, prompt=PROMPTS[:3], max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, p in zip(r.choices, PROMPTS[:3]):
        ref = llm.generate([p], greedy(12), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == ref.token_ids and c.text == ref.text and c.finish_reason == "length"
    assert r.usage.completion_tokens == 36
    assert r.usage.prompt_tokens == sum(len(llm.get_tokenizer().encode(p)) for p in PROMPTS[:3])
    ids = [5, 17, 99, 3]
    r = client.completions.create(
        model=NAME, prompt=ids, max_tokens=7, temperature=0, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].token_ids == alone(llm, {"prompt_token_ids": ids}, 7)
    assert r.choices[0].prompt_token_ids == ids and r.usage.prompt_tokens == 4


def test_penalties_and_bias_equal_llm_generate(server, llm):
    sp = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.5, presence_penalty=0.5, logit_bias={65: 3.0})
    ref = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0].outputs[0]
    r = server.openai().completions.create(
        model=NAME,
        prompt=PROMPTS[1],
        max_tokens=8,
        temperature=0,
        presence_penalty=0.5,
        logit_bias={"65": 3.0},
        extra_body={"repetition_penalty": 1.5, "return_token_ids": True},
    )
    assert r.choices[0].token_ids == ref.token_ids


def test_n_choices_equal_llm_generate(server, llm):
    sp = SamplingParams(n=2, seed=3, max_tokens=6, temperature=1.0)
    ref = llm.generate(PROMPTS[2:4], sp, use_tqdm=False)
    client = server.openai()
    r = client.completions.create(model=NAME, prompt=PROMPTS[2:4], n=2, seed=3, max_tokens=6, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [c.text for o in ref for c in o.outputs]
    assert r.usage.completion_tokens == sum(len(c.token_ids) for o in ref for c in o.outputs)
    chunks = client.completions.create(
        model=NAME, prompt=PROMPTS[2], n=2, seed=3, max_tokens=6, temperature=1.0, stream=True
    )
    texts, ends = {0: "", 1: ""}, {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                assert c.index not in ends  # each choice ends once
                ends[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in ref[0].outputs] and set(ends) == {0, 1}
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], n=2, seed=1, max_tokens=4
    )
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.role == "assistant" for c in chat.choices)


def test_best_of_echo_and_prompt_logprobs_equal_llm_generate(server, llm):
    sp = SamplingParams(n=1, best_of=3, seed=5, max_tokens=5, temperature=1.0, prompt_logprobs=2)
    ref = llm.generate([PROMPTS[3]], sp, use_tqdm=False)[0]
    client = server.openai()
    r = client.completions.create(
        model=NAME,
        prompt=PROMPTS[3],
        best_of=3,
        seed=5,
        max_tokens=5,
        temperature=1.0,
        echo=True,
        extra_body={"prompt_logprobs": 2},
    )
    [c] = r.choices
    assert c.text == PROMPTS[3] + ref.outputs[0].text  # echo: the prompt, then the best of the 3 samples
    got = c.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for g, want in zip(got[1:], ref.prompt_logprobs[1:]):
        assert {int(k): v["logprob"] for k, v in g.items()} == pytest.approx({k: v.logprob for k, v in want.items()})
        assert {int(k): v["rank"] for k, v in g.items()} == {k: v.rank for k, v in want.items()}
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and all(len(d) == 1 for d in plp[1:])  # just the prompt's own token at each position


def test_stop_and_logprobs_equal_llm_generate(server, llm):
    client = server.openai()
    ref = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0, logprobs=2), use_tqdm=False)
    ref = ref[0].outputs[0]
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)])
    for got, want in zip(lp.top_logprobs, ref.logprobs):  # keyed by token text: byte tokens may share one
        assert all(any(v == pytest.approx(w.logprob) for w in want.values()) for v in got.values())
    # A stop string from the middle of the greedy text cuts it there.
    stop = ref.text[3:5]
    if stop and "\ufffd" not in stop:
        r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0, stop=[stop])
        assert r.choices[0].text == ref.text[: ref.text.index(stop)] and r.choices[0].finish_reason == "stop"


def test_chat_equals_llm_chat_streaming_or_not(server, llm):
    client = server.openai()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
    ]
    as_strings = [messages[0], {"role": "user", "content": "hello\nthere"}]
    ref = llm.chat(as_strings, greedy(9), use_tqdm=False)[0]
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=9, temperature=0, extra_body={"return_token_ids": True}
    )
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref.outputs[0].text
    assert c.token_ids == ref.outputs[0].token_ids and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.total_tokens == len(ref.prompt_token_ids) + 9
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_completion_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.outputs[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_64_concurrent_streams_each_equal_alone(server, llm):
    async def one(client, prompt):
        stream = await client.completions.create(
            model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body={"return_token_ids": True}
        )
        ids, text = [], ""
        async for ch in stream:
            ids += ch.choices[0].token_ids
            text += ch.choices[0].text
        return ids, text

    async def all_of_them():
        client = server.async_openai()
        return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    got = asyncio.run(all_of_them())
    for p, (ids, text) in zip(PROMPTS, got):
        ref = llm.generate([p], greedy(8), use_tqdm=False)[0].outputs[0]
        assert ids == ref.token_ids and text == ref.text


def _kv_freed_without_finishing(server, finished_before: float) -> None:
    """KV usage returns to zero and no request finished: the one in flight was aborted."""
    m = server.wait_idle()
    assert m.get("ctxpar:request_success_total", 0) == finished_before


def _in_flight(server, finished_before: float) -> bool:
    """Whether the request streaming now holds KV blocks (the gauge is set after each step),
    False if it finished first: 450 tokens take this tiny model a few tenths of a second,
    which a loaded host's client can spend before it reads the gauge."""
    deadline = time.monotonic() + 30
    while True:
        m = metrics(server)
        if m["ctxpar:kv_cache_usage_perc"] > 0:
            return True
        if m.get("ctxpar:request_success_total", 0) > finished_before:
            return False
        assert time.monotonic() < deadline, "no KV block in use while a request streams"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_kv(server, stream):
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 450, "temperature": 0, "stream": stream}
    with httpx.Client(timeout=300, headers=server.headers()) as http:
        if stream:
            for _ in range(5):  # until the request is caught in flight (see _in_flight)
                finished = metrics(server).get("ctxpar:request_success_total", 0)
                with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                    lines = r.iter_lines()  # kept: a generator over the body, dropped, closes the stream
                    first = next(line for line in lines if line.startswith("data:"))
                    assert '"text"' in first, first  # a token, not an error
                    caught = _in_flight(server, finished)
                # The connection closes mid-stream (when caught).
                if caught:
                    break
                server.wait_idle()
            else:
                pytest.fail("the streaming request finished before its KV blocks were seen, 5 times")
        else:
            finished = metrics(server).get("ctxpar:request_success_total", 0)
            # The client gives up waiting and closes the connection: well before the 450 tokens,
            # which this tiny model decodes in a few tenths of a second.
            with pytest.raises(httpx.ReadTimeout):
                http.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.05))
    _kv_freed_without_finishing(server, finished)


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=60)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200  # health stays open, metrics not
    assert httpx.get(server.url + "/metrics", timeout=60).status_code == 401
    assert httpx.get(server.url + "/metrics", headers=server.headers(), timeout=60).status_code == 200


BAD = [
    # (path, body, status, words in the message)
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, ["temperature", ">= 0"]),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, ["n must be", "0"]),
    ("/v1/completions", {"prompt": "x", "stream": True, "temperature": -1}, 400, ["temperature"]),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, ["presence_penalty", "[-2, 2]"]),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1.0}}, 400, ["logit_bias", "99999", "vocabulary"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens=0", "echo"]),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, 400, ["best_of", "stream"]),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "n": 4}, 400, ["best_of", "n=4"]),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, ["prompt_logprobs", "stream"]),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 50}, 400, ["prompt_logprobs", "50"]),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, ["frobnicate"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, ["max_tokens"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens"]),
    ("/v1/completions", {"prompt": "x" * 600}, 400, ["600 tokens", "max_model_len=512"]),
    ("/v1/completions", {"prompt": "x" * 500, "max_tokens": 100}, 400, ["maximum context length", "max_tokens"]),
    ("/v1/completions", {"prompt": [1, 2, 999]}, 400, ["999", "vocabulary"]),
    ("/v1/completions", {"prompt": []}, 400, ["prompt"]),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, ["logprobs"]),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, ["stream_options"]),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, ["gpt-4", NAME]),
    ("/v1/completions", {}, 400, ["prompt"]),
    ("/v1/chat/completions", {"messages": []}, 400, ["messages"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, ["image_url"]),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        ["tools"],
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, ["logprobs"]),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3},
        400,
        ["max_completion_tokens"],
    ),
    ("/detokenize", {"tokens": [300]}, 400, ["300", "vocabulary"]),
    ("/tokenize", {}, 400, ["prompt", "messages"]),
]


@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{p}:{sorted(b)}" for p, b, _, _ in BAD])
def test_bad_request_gets_its_status_and_the_server_keeps_serving(server, path, body, status, words):
    r = httpx.post(server.url + path, json=body, headers=server.headers(), timeout=300)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and all(w in err["message"] for w in words), err
    ok = httpx.post(
        server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=server.headers(), timeout=300
    )
    assert ok.status_code == 200


def test_invalid_json_is_400(server):
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{not json",
        headers=server.headers() | {"Content-Type": "application/json"},
        timeout=300,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_tokenize_detokenize(server, llm):
    h = server.headers()
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello"}, headers=h, timeout=300).json()
    assert r["tokens"] == list(llm.get_tokenizer().encode("hello")) and r["count"] == 5 and r["max_model_len"] == 512
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=h, timeout=300).json()
    assert back["prompt"] == "hello"
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}, headers=h, timeout=300).json()
    assert r["tokens"] == llm.apply_chat_template(msgs)[0]["prompt_token_ids"]


def test_metrics_parse_and_count(server):
    m = metrics(server)
    for name in (
        "ctxpar:num_requests_running",
        "ctxpar:num_requests_waiting",
        "ctxpar:kv_cache_usage_perc",
        "ctxpar:prompt_tokens_total",
        "ctxpar:generation_tokens_total",
        "ctxpar:time_to_first_token_seconds_count",
        "ctxpar:inter_token_latency_seconds_count",
        "ctxpar:pcp_collective_seconds_total",
    ):
        assert name in m, name
    assert m["ctxpar:generation_tokens_total"] > 0 and m["ctxpar:time_to_first_token_seconds_count"] > 0


def test_sigterm_ends_in_flight_streams_and_exits(server):
    """Last in the module: stop accepting, end the stream in flight, exit with no child left."""
    stream = server.openai().completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=300, temperature=0, stream=True
    )
    first = next(iter(stream))
    assert first.choices
    assert server.stop() in STOPPED
    try:
        for _ in stream:  # the stream ends: finished within the grace period, or cut after it
            pass
    except (openai.APIError, httpx.HTTPError):
        pass
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=10)
