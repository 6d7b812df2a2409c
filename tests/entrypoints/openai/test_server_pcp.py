"""`ctxpar serve --pcp 2`: concurrent streams equal one rank's outputs; a dead
rank fails requests with a clear message and turns /health to 503; no rank
outlives the server."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ctxpar import LLM, SamplingParams
from helpers.server_harness import STOPPED, Server, alive
from helpers.tiny_tokenizer import with_byte_tokenizer

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

PROMPTS = [f"pcp {i}: " + "all work and no play " * (1 + i % 7) for i in range(64)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    return with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("serve_pcp") / "llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # --pcp-min-tokens 0: even these short prompts are split across the two ranks.
    args = ["--model", str(model_dir), "--served-model-name", "tiny", "--pcp", "2", "--pcp-min-tokens", "0"]
    s = Server([*args, "--threads", "1"], log=tmp_path_factory.mktemp("serve_pcp_log") / "server.log")
    yield s
    assert s.stop(signal.SIGINT) in STOPPED, s.log()  # Ctrl-C; and no rank left behind (stop checks)


def test_64_concurrent_streams_equal_one_rank(server, model_dir):
    async def one(client, prompt):
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True, extra_body={"return_token_ids": True}
        )
        return [t async for ch in stream for t in ch.choices[0].token_ids]

    async def all_of_them():
        return await asyncio.gather(*(one(server.async_openai(), p) for p in PROMPTS))

    got = asyncio.run(all_of_them())
    with LLM(str(model_dir), num_threads=1) as llm:  # one rank, each prompt alone
        for p, ids in zip(PROMPTS, got):
            assert (
                ids
                == llm.generate([p], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
                .outputs[0]
                .token_ids
            )
    text = httpx.get(server.url + "/metrics", timeout=60).text
    m = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.labels.get("group") in ("data", None)
    }
    assert m["ctxpar:pcp_collective_seconds_total"] > 0


def test_dead_rank_fails_requests_and_health(server):
    """Last in the module: it kills rank 1 under a stream in flight."""
    stream = server.openai().completions.create(
        model="tiny", prompt="hello", max_tokens=400, stream=True, temperature=0
    )
    next(iter(stream))
    worker = server.rank_pid()
    os.kill(worker, signal.SIGKILL)
    while alive(worker):
        time.sleep(0.1)
    # The stream in flight ends with an error event naming the failure (no hang).
    with pytest.raises(openai.APIError, match="PCP rank"):
        for _ in stream:
            pass
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=300)
    assert r.status_code == 503, r.text
    assert "PCP rank" in r.json()["error"]["message"] and "restart" in r.json()["error"]["message"]
    health = httpx.get(server.url + "/health", timeout=60)
    assert health.status_code == 503 and "PCP rank" in health.json()["error"]["message"]
    # New requests fail at once, streaming or not, with the same reason.
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=60)
    assert r.status_code == 503 and "PCP rank" in r.json()["error"]["message"]
