"""vLLM's request extensions on `ctxpar serve`, each honoured as vLLM honours it
(docs/vllm.md lists every field of vLLM's request models): the prompt's special
tokens and truncation, tokens named by id, the response id, stream chunking,
priority, and the chat template's options. References come from the offline API
on the same checkpoint.

The tiny model's byte tokenizer gets a BOS here (byte 1, added by its
post-processor), so that add_special_tokens changes the prompt.
"""

from __future__ import annotations

import json

import httpx
import pytest

from ctxpar import LLM, SamplingParams
from helpers.server_harness import STOPPED, Server
from helpers.tiny_tokenizer import byte_tokenizer

pytestmark = pytest.mark.multiprocess  # a server process

NAME = "tiny"
BOS = 1
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    import shutil

    from tokenizers import processors

    out = tmp_path_factory.mktemp("vllm_fields") / "llama"
    shutil.copytree(tiny_model_dirs["llama"], out)
    tok = byte_tokenizer()
    bos = tok.convert_ids_to_tokens(BOS)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, BOS)]
    )
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    args = ["--model", str(model_dir), "--served-model-name", NAME, "--threads", "1"]
    s = Server(args, log=tmp_path_factory.mktemp("vllm_fields_log") / "server.log")
    yield s
    assert s.stop() in STOPPED, s.log()
    assert "Traceback" not in s.log()


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), num_threads=1) as llm:
        yield llm


def post(server, path: str, body: dict, status: int = 200, headers: dict | None = None) -> dict:
    r = httpx.post(server.url + path, json={"model": NAME, **body}, headers=headers or {}, timeout=300)
    assert r.status_code == status, r.text
    return r.json()


def completion(server, **body) -> dict:
    return post(server, "/v1/completions", {"max_tokens": 4, "temperature": 0, "return_token_ids": True, **body})


def test_add_special_tokens(server, llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    assert ids[0] == BOS  # the fixture's tokenizer adds it
    [c] = completion(server, prompt=PROMPT)["choices"]
    assert c["prompt_token_ids"] == ids
    [c] = completion(server, prompt=PROMPT, add_special_tokens=False)["choices"]
    assert c["prompt_token_ids"] == ids[1:]
    chat = [{"role": "user", "content": "hi"}]
    [rendered] = llm.apply_chat_template(chat)
    r = post(server, "/v1/chat/completions", {"messages": chat, "max_tokens": 2, "return_token_ids": True})
    assert r["choices"][0]["prompt_token_ids"] == rendered["prompt_token_ids"]  # vLLM's chat default: none added
    body = {"messages": chat, "max_tokens": 2, "return_token_ids": True, "add_special_tokens": True}
    r = post(server, "/v1/chat/completions", body)
    assert r["choices"][0]["prompt_token_ids"] == [BOS, *rendered["prompt_token_ids"]]


def test_truncate_prompt_tokens(server, llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    [c] = completion(server, prompt=PROMPT, truncate_prompt_tokens=5)["choices"]
    assert c["prompt_token_ids"] == ids[-5:]
    [ref] = llm.generate([{"prompt_token_ids": ids[-5:]}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert c["token_ids"] == ref.outputs[0].token_ids
    [c] = completion(server, prompt=PROMPT, truncate_prompt_tokens=5, truncation_side="right", echo=True)["choices"]
    assert c["prompt_token_ids"] == ids[:5] and c["text"].startswith(llm.get_tokenizer().decode(ids[:5]))
    [c] = completion(server, prompt=PROMPT * 40, truncate_prompt_tokens=-1)["choices"]
    assert len(c["prompt_token_ids"]) == 508  # max_model_len 512, room for max_tokens 4
    for bad in (0, -2):
        e = post(server, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": bad}, status=400)
        assert "truncate_prompt_tokens" in e["error"]["message"]


def test_tokens_as_token_ids_and_request_id(server):
    r = completion(server, prompt=PROMPT, logprobs=2, return_tokens_as_token_ids=True, request_id="job-1")
    assert r["id"] == "cmpl-job-1"
    [c] = r["choices"]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] for k in top)
    headed = httpx.post(
        server.url + "/v1/completions",
        json={"model": NAME, "prompt": PROMPT, "max_tokens": 1, "request_id": "body"},
        headers={"X-Request-Id": "header"},
        timeout=60,
    )
    assert headed.json()["id"] == "cmpl-header"  # vLLM's order: the header first
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    r = post(server, "/v1/chat/completions", {**body, "return_tokens_as_token_ids": True, "request_id": "c-2"})
    assert r["id"] == "chatcmpl-c-2"
    assert all(e["token"].startswith("token_id:") for e in r["choices"][0]["logprobs"]["content"])


def test_priority_changes_no_output(server):
    plain = completion(server, prompt=PROMPT)["choices"][0]
    for priority in (-5, 7):
        assert completion(server, prompt=PROMPT, priority=priority)["choices"][0]["token_ids"] == plain["token_ids"]


def test_stream_interval(server):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_interval": 4, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks]
    assert sum(sizes) == 10 and all(s >= 4 for s in sizes[1:-1])


def test_chat_template_options_and_echo(server, llm):
    greedy = SamplingParams(max_tokens=6, temperature=0)
    prefix = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello the"}]
    [ref] = llm.chat(prefix, greedy, continue_final_message=True, add_generation_prompt=False, use_tqdm=False)
    body = {"messages": prefix, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    r = post(server, "/v1/chat/completions", {**body, "continue_final_message": True, "add_generation_prompt": False})
    [c] = r["choices"]
    assert c["token_ids"] == ref.outputs[0].token_ids and c["prompt_token_ids"] == ref.prompt_token_ids
    r = post(
        server,
        "/v1/chat/completions",
        {**body, "continue_final_message": True, "add_generation_prompt": False, "echo": True},
    )
    assert r["choices"][0]["message"]["content"] == "Hello the" + ref.outputs[0].text
    [no_prompt] = llm.apply_chat_template(prefix[:1], add_generation_prompt=False)
    r = post(server, "/v1/chat/completions", {**body, "messages": prefix[:1], "add_generation_prompt": False})
    assert r["choices"][0]["prompt_token_ids"] == no_prompt["prompt_token_ids"]
    extras = {"documents": [{"title": "t", "text": "x"}], "reasoning_effort": "low", "include_reasoning": False}
    post(server, "/v1/chat/completions", {**body, "messages": prefix[:1], **extras})  # the template may ignore them
    e = post(server, "/v1/chat/completions", {**body, "chat_template": "{{ x }}"}, status=400)
    assert e["error"]["param"] == "chat_template"
    e = post(server, "/v1/chat/completions", {**body, "continue_final_message": True}, status=400)
    assert "add_generation_prompt" in e["error"]["message"]


def test_priority_reaches_the_engine_request(model_dir):
    """The body's priority is the engine request's, which the scheduler orders by
    (tests/engine/test_scheduler_priority.py)."""
    from ctxpar.entrypoints.openai import prompts
    from ctxpar.entrypoints.openai.access import Access
    from ctxpar.entrypoints.openai.protocol import parse
    from ctxpar.entrypoints.openai.protocol_completions import CompletionRequest
    from ctxpar.entrypoints.openai.state import ServerState

    with LLM(str(model_dir), num_threads=1) as llm:
        state = ServerState(llm, NAME, Access())
        req = parse(CompletionRequest, json.dumps({"prompt": ["a", "b"], "priority": -3}).encode())
        assert [r.priority for r in prompts.completion_requests(state, req, req.prompts(), None)] == [-3, -3]
