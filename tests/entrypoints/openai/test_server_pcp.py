"""`ctxpar serve --pcp 2`: concurrent streams equal one rank's outputs; a rank
killed under a stream in flight is respawned and the stream ends with exactly
the text of an undisturbed run; no rank outlives the server."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ctxpar import LLM, SamplingParams
from helpers.server_harness import STOPPED, Server
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


def test_rank_killed_mid_stream_is_recovered(server):
    """Rank 1 dies under a stream in flight: it is respawned, its KV restored, and the
    stream goes on to the very text it streams undisturbed; /health and /metrics say what happened."""
    body = dict(model="tiny", prompt="hello there", max_tokens=200, temperature=0)
    ignore_eos = {"ignore_eos": True}

    def stream_text(kill: bool) -> str:
        stream = server.openai().completions.create(**body, stream=True, extra_body=ignore_eos)
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        if kill:
            worker = server.rank_pid()
            os.kill(worker, signal.SIGKILL)
        return text + "".join(ch.choices[0].text for ch in chunks)

    undisturbed = stream_text(kill=False)
    assert stream_text(kill=True) == undisturbed
    health = httpx.get(server.url + "/health", timeout=60).json()
    assert health["status"] == "healthy" and health["rank_failures"] == 1 and health["rank_recoveries"] == 1
    m = server.metrics()
    assert m["ctxpar:rank_failures_total"] == 1 and m["ctxpar:rank_recoveries_total"] == 1
    assert m["ctxpar:copied_kv_tokens_total"] > 0  # no DCP: the whole cache is copied from rank 0
    r = httpx.post(server.url + "/v1/completions", json={**body, **ignore_eos, "max_tokens": 4}, timeout=300)
    assert r.status_code == 200, r.text
