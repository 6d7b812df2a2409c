"""The bodies that the clients vLLM users run build, replayed against `ctxpar serve`
on the default model, each answer checked for what that client reads of it.

The bodies are derived from each client's source:

- lm-evaluation-harness 0.4.13, ``lm_eval/models/openai_completions.py``:
  ``LocalCompletionsAPI._create_payload`` (loglikelihood: the prompt as token ids,
  ``max_tokens`` 1, ``logprobs`` 1, ``echo``; generate_until: ``stop``, ``seed``),
  ``parse_logprobs`` (``sum(token_logprobs[ctxlen:-1])``, greedy when each equals
  ``max(top_logprobs)``), ``LocalChatCompletion._create_payload``; and
  ``lm_eval/utils.py``: ``check_remote_tokenizer_support`` (GET /tokenizer_info
  with ``eos_token``, then POST /tokenize), which picks its tokenizer backend.
- guidellm 0.8.1, ``guidellm/backends/openai/request_handlers.py``:
  ``TextCompletionsRequestHandler.format`` and ``ChatCompletionsRequestHandler.format``
  (``stream_options`` with ``continuous_usage_stats``, ``stop`` null, ``ignore_eos``,
  the user's content as text parts).
- vLLM's ``vllm bench serve``, ``vllm/benchmarks/lib/endpoint_request_func.py``:
  ``async_request_openai_completions`` (``repetition_penalty`` 1.0, ``logprobs`` null,
  ``x-request-id`` header) and ``async_request_openai_chat_completions``
  (``max_completion_tokens``, content parts).
- Open WebUI, ``backend/open_webui/routers/openai.py``: ``generate_chat_completion``
  (``stream_options.include_usage`` when streaming, a ``cache_control`` marker on
  the last content part); it lists models from /v1/models.

Scores are compared with the offline API's ``prompt_logprobs`` with ``==``: the
same model in another process gives the same bits (docs/architecture.md).
"""

from __future__ import annotations

import json

import httpx
import pytest

from ctxpar import LLM, SamplingParams
from helpers.server_harness import STOPPED, Server

pytestmark = pytest.mark.multiprocess  # a server process

NAME = "SmolLM2-135M-Instruct"  # the default model's served name
CONTEXT = "Question: What is the capital of France?\nAnswer:"
CHOICES = [" Paris", " London", " the moon"]
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(["--threads", "1"], log=tmp_path_factory.mktemp("serve_clients") / "server.log")
    yield s
    assert s.stop() in STOPPED, s.log()
    assert "Traceback" not in s.log()


@pytest.fixture(scope="module")
def llm():
    with LLM(num_threads=1) as llm:
        yield llm


def post(server, path: str, body: dict, headers: dict | None = None) -> dict:
    r = httpx.post(server.url + path, json=body, headers=headers or {}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def events(server, path: str, body: dict, headers: dict | None = None) -> list[dict]:
    """The JSON events of a stream, [DONE] checked and dropped."""
    r = httpx.post(server.url + path, json=body, headers=headers or {}, timeout=300)
    assert r.status_code == 200, r.text
    lines = [ln[len("data: ") :] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def encode(llm, text: str) -> list[int]:
    return list(llm.get_tokenizer().encode(text, add_special_tokens=False))


def offline_prompt_logprobs(llm, ids: list[int], k: int = 1) -> list:
    [out] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    return out.prompt_logprobs


def lm_eval_score(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """LocalCompletionsAPI.parse_logprobs of one choice, as lm-eval computes it."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(t == max(top.values()) for t, top in zip(lps, tops))


def test_lm_eval_loglikelihood_equals_offline_prompt_logprobs(server, llm):
    ctx = encode(llm, CONTEXT)
    scores = []
    for cont in CHOICES:
        ids = ctx + encode(llm, CONTEXT + cont)[len(ctx) :]
        body = {"model": NAME, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
        [choice] = post(server, "/v1/completions", {**body, "echo": True})["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = offline_prompt_logprobs(llm, ids)
        assert lp["token_logprobs"][1 : len(ids)] == [ref[p][ids[p]].logprob for p in range(1, len(ids))]
        tops = [{llm.get_tokenizer().decode([t]): v.logprob for t, v in ref[p].items()} for p in range(1, len(ids))]
        assert lp["top_logprobs"][1 : len(ids)] == tops
        score, greedy = lm_eval_score(choice, len(ctx))
        expect = [ref[p][ids[p]].logprob for p in range(len(ctx), len(ids))]
        assert score == sum(expect)
        assert greedy == all(ref[p][ids[p]].rank == 1 for p in range(len(ctx), len(ids)))
        text = llm.get_tokenizer().decode(ids)
        assert choice["text"].startswith(text) and lp["text_offset"][0] == 0
        assert lp["text_offset"] == sorted(lp["text_offset"])
        scores.append((score, greedy))
    # lm-eval with batch_size > 1 sends the batch's prompts in one request: the same scores, by index.
    batch = [ctx + encode(llm, CONTEXT + cont)[len(ctx) :] for cont in CHOICES]
    body = {"model": NAME, "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True}
    choices = sorted(post(server, "/v1/completions", body)["choices"], key=lambda c: c["index"])
    assert [lm_eval_score(c, len(ctx)) for c in choices] == scores


def test_echo_max_tokens_zero_and_streamed(server, llm):
    ids = encode(llm, CONTEXT + CHOICES[0])
    ref = offline_prompt_logprobs(llm, ids, 2)
    body = {"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}
    [choice] = post(server, "/v1/completions", body)["choices"]
    assert choice["text"] == llm.get_tokenizer().decode(ids) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None] + [ref[p][ids[p]].logprob for p in range(1, len(ids))]
    assert [len(t) for t in choice["logprobs"]["top_logprobs"][1:]] == [len(e) for e in ref[1:]]
    # Streamed, with a generated token after the prompt: the prompt and its scores come first.
    chunks = events(server, "/v1/completions", {**body, "max_tokens": 3, "temperature": 0, "stream": True})
    streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[: len(ids)] == choice["logprobs"]["token_logprobs"] and len(streamed) == len(ids) + 3
    assert "".join(c["choices"][0]["text"] for c in chunks).startswith(choice["text"])
    # The hidden token is an EOS: the answer still ends at max_tokens 0, as vLLM's does.
    eos = {str(llm.get_tokenizer().eos_token_id): 100}
    [choice] = post(server, "/v1/completions", {**body, "logit_bias": eos})["choices"]
    assert choice["finish_reason"] == "length" and choice["text"] == llm.get_tokenizer().decode(ids)
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=60)
    assert bad.status_code == 400 and "echo" in bad.json()["error"]["message"]


def test_lm_eval_generate_until_and_chat(server, llm):
    ids = encode(llm, CONTEXT)
    greedy = SamplingParams(max_tokens=24, temperature=0, stop=["\n\n"], seed=1234)
    [ref] = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)
    body = {"model": NAME, "prompt": [ids], "max_tokens": 24, "temperature": 0, "stop": ["\n\n"], "seed": 1234}
    [choice] = post(server, "/v1/completions", body)["choices"]
    assert choice["text"] == ref.outputs[0].text
    [chat_ref] = llm.chat(CHAT, SamplingParams(max_tokens=24, temperature=0, stop=["<|im_end|>"]), use_tqdm=False)
    body = {"messages": CHAT, "model": NAME, "max_tokens": 24, "temperature": 0, "stop": ["<|im_end|>"], "seed": 1234}
    [choice] = post(server, "/v1/chat/completions", body)["choices"]
    assert choice["message"]["content"] == chat_ref.outputs[0].text


def test_lm_eval_finds_the_remote_tokenizer(server, llm):
    info = httpx.get(server.url + "/tokenizer_info", timeout=60).json()
    tok = llm.get_tokenizer()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    tokens = post(server, "/tokenize", {"prompt": "test", "add_special_tokens": False})["tokens"]
    assert tokens == encode(llm, "test")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_default_body_streams_usage_in_every_chunk(server, llm, path):
    text = "Tell me about the sea."
    body: dict = {
        "model": NAME,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "stop": None,
        "ignore_eos": True,
    }
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    if path == "/v1/completions":
        body |= {"max_tokens": 12, "prompt": text, "temperature": 0}
        [ref] = llm.generate([text], greedy, use_tqdm=False)
        read = "text"
    else:
        body |= {"max_completion_tokens": 12, "temperature": 0}
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        [ref] = llm.chat([{"role": "user", "content": text}], greedy, use_tqdm=False)
        read = "delta"
    chunks = events(server, path, body)
    prompt = len(ref.prompt_token_ids)
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    done = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert done == sorted(done) and done[-1] == 12
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 12,
        "total_tokens": prompt + 12,
    }
    got = "".join(
        (c["choices"][0]["text"] if read == "text" else c["choices"][0]["delta"].get("content") or "")
        for c in chunks
        if c["choices"]
    )
    assert got == ref.outputs[0].text


def test_vllm_bench_serve_bodies(server, llm):
    headers = {"x-request-id": "bench-7"}
    body = {
        "model": NAME,
        "prompt": "The capital of France is",
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    chunks = events(server, "/v1/completions", body, headers)
    assert {c["id"] for c in chunks} == {"cmpl-bench-7"} and chunks[-1]["usage"]["completion_tokens"] == 8
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_completion_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    chunks = events(server, "/v1/chat/completions", body, headers)
    assert {c["id"] for c in chunks} == {"chatcmpl-bench-7"} and chunks[-1]["usage"]["completion_tokens"] == 8


def test_open_webui_style_models_and_streamed_chat(server, llm):
    """What an Open WebUI-style client reads: the model card (vLLM's fields) and a streamed
    chat through the openai client, the role first and the usage last."""
    [card] = server.openai().models.list().data
    assert (card.id, card.object, card.owned_by, card.root) == (NAME, "model", "ctxpar", NAME)
    assert card.max_model_len > 0 and card.parent is None and card.permission[0]["allow_sampling"]
    stream = server.openai().chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    [ref] = llm.chat(CHAT, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    # Open WebUI's own body (backend/open_webui/routers/openai.py, generate_chat_completion): usage asked for
    # when streaming, and an ephemeral cache_control marker on the last message's last content part.
    part = {"type": "text", "text": CHAT[0]["content"], "cache_control": {"type": "ephemeral"}}
    body = {"model": NAME, "messages": [{"role": "user", "content": [part]}], "stream": True, "max_tokens": 8}
    body |= {"temperature": 0, "stream_options": {"include_usage": True}}
    streamed = events(server, "/v1/chat/completions", body)
    assert (
        "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e["choices"]) == ref.outputs[0].text
    )
