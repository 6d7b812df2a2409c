"""`ctxpar serve` against hostile and broken clients (loopback, bounded in count
and time): each gets a clear OpenAI-style error or a correct answer, the
requests of others are unaffected, the KV cache is wholly free once they are
gone, and SIGTERM still stops everything within the grace period.

One server for the module, with small limits so that the slow-client cases
take seconds: --timeout-client 4, --max-body-size 64 KiB, a 1 s grace period.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from ctxpar import LLM, SamplingParams
from helpers.raw_http import connect, read_response, request_head, send_half
from helpers.server_harness import STOPPED, Server
from helpers.tiny_tokenizer import with_byte_tokenizer

pytestmark = pytest.mark.multiprocess  # a server process

NAME = "tiny"
GRACE_S = 1
CLIENT_S = 4
STOP_MARGIN_S = 5  # ctxpar/entrypoints/openai/shutdown.py: the bound past the grace period
PROMPTS = [f"client {i}: the quick brown fox" + " jumps" * (i % 4) for i in range(16)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    return with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("hostile") / "llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    args = ["--model", str(model_dir), "--served-model-name", NAME, "--threads", "1", "--kv-cache-blocks", "512"]
    args += ["--timeout-client", str(CLIENT_S), "--max-body-size", "65536", "--timeout-graceful-shutdown", str(GRACE_S)]
    s = Server(args, log=tmp_path_factory.mktemp("hostile_log") / "server.log")
    yield s
    s.stop()


def completion(server, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120, **kw)


def assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] and all(w in err["message"] for w in words), err


def assert_serves(server) -> None:
    r = completion(server, {"prompt": "still there?", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


BAD_BODIES = {
    "malformed": (b'{"prompt": "x", max_tokens: 3}', "Invalid JSON"),
    "truncated": (b'{"prompt": "the quick brown', "Invalid JSON"),
    "invalid utf-8": (b'{"prompt": "\xff\xfe\xfa"}', "Invalid JSON"),
    "lone surrogate": (b'{"prompt": "\\udc80"}', "Invalid JSON"),
    "deeply nested": (b"[" * 10000, "Invalid JSON"),
    "not an object": (b"[1, 2, 3]", "body"),
}


@pytest.mark.parametrize("kind", list(BAD_BODIES))
def test_bad_json_is_a_400(server, kind):
    raw, words = BAD_BODIES[kind]
    r = httpx.post(
        server.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert_error(r, 400, words)
    assert_serves(server)


HUGE = [
    ({"n": 10**9}, ["n"]),
    ({"max_tokens": 10**12}, ["max_tokens", "maximum context length"]),
    ({"logprobs": 10**6}, ["logprobs", "20"]),
    ({"best_of": 10**9}, ["best_of"]),
    ({"prompt": list(range(100)) * 10}, ["1000 tokens", "max_model_len=512"]),  # an oversized prompt
    ({"prompt": "x" * 20000}, ["20000 tokens", "max_model_len=512"]),
]


@pytest.mark.parametrize("fields,words", HUGE, ids=[next(iter(f)) + f"-{i}" for i, (f, _) in enumerate(HUGE)])
def test_huge_values_are_a_400(server, fields, words):
    assert_error(completion(server, {"prompt": "x", **fields}), 400, *words)


def test_huge_top_logprobs_in_chat_is_a_400(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 10**6}
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60), 400, "logprobs")


def test_oversized_body_is_a_413_declared_or_not(server):
    big = {"prompt": "x" * 70000}
    assert_error(completion(server, big), 413, "65536 bytes")
    # Sent chunked, without a Content-Length: refused once 64 KiB have arrived.
    chunks = (json.dumps(big)[i : i + 8192].encode() for i in range(0, 70020, 8192))
    r = httpx.post(
        server.url + "/v1/completions", content=chunks, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert_error(r, 413, "65536 bytes")
    assert_serves(server)


def test_slow_sender_gets_a_408(server):
    s = send_half(server.url, "/v1/completions", {"prompt": "slow", "max_tokens": 2})
    t0 = time.monotonic()
    status, headers, body = read_response(s, timeout=30)
    s.close()
    assert status == 408 and json.loads(body)["error"]["code"] == 408
    assert CLIENT_S - 0.5 < time.monotonic() - t0 < CLIENT_S + 5
    assert_serves(server)


def test_half_sent_bodies_then_disconnect_leave_no_trace(server):
    socks = [send_half(server.url, "/v1/completions", {"prompt": f"half {i}", "max_tokens": 2}) for i in range(64)]
    for s in socks:
        s.close()
    assert_serves(server)
    assert "Traceback" not in server.log() and "ClientDisconnect" not in server.log()


def test_slow_reader_is_dropped(server):
    """A streaming client that reads nothing: once the socket buffers are full the
    server's send blocks, and after --timeout-client s the server drops the
    connection (the stream never reaches [DONE]), logs whom it dropped, and forgets
    the request."""
    # About 9 MB of events (16 choices x 480 tokens x 20 top logprobs with their bytes):
    # more than loopback's socket buffers (4 MB at most) hold.
    body = {"messages": [{"role": "user", "content": "read me"}], "max_tokens": 480, "n": 16, "stream": True}
    body.update(logprobs=True, top_logprobs=20, ignore_eos=True, temperature=1.0, seed=0)
    raw = json.dumps(body).encode()
    s = connect(server.url, rcvbuf=4096)
    s.sendall(request_head("/v1/chat/completions", len(raw)) + raw)
    deadline = time.monotonic() + 60
    while server.metrics()["ctxpar:num_requests_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Read nothing until the server says it dropped the client: a fixed wait races a
    # loaded machine, where the buffers fill later and the reads would let the stream end.
    while f"that read none of its response for {CLIENT_S} s" not in server.log():
        assert time.monotonic() < deadline + 60, server.log()
        time.sleep(0.1)
    s.settimeout(30)
    received = b""
    while chunk := s.recv(1 << 20):  # what the buffers held, then the server's close
        received += chunk
    s.close()
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    server.wait_idle()
    assert_serves(server)


def test_clients_leaving_mid_stream_abort_their_requests(server):
    before = server.metrics().get("ctxpar:request_success_total", 0)

    async def leave_after_first_chunk(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": PROMPTS[i % 16], "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return  # closing the response closes the connection mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
            await asyncio.gather(*(leave_after_first_chunk(client, i) for i in range(32)))

    asyncio.run(run())
    m = server.wait_idle()
    assert m.get("ctxpar:request_success_total", 0) == before  # all 32 were aborted, none ran to the end


def test_256_concurrent_streams_each_equal_alone(server, model_dir):
    async def one(client: httpx.AsyncClient, prompt: str) -> list[int]:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "return_token_ids": True}
        ids = []
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
        return ids

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
            return await asyncio.gather(*(one(client, PROMPTS[i % 16]) for i in range(256)))

    got = asyncio.run(run())
    with LLM(str(model_dir), num_threads=1) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))]
    assert all(ids == want[i % 16] for i, ids in enumerate(got))
    server.wait_idle()


def test_sigterm_after_half_sent_bodies_stops_within_the_grace_period(server):
    """Last: 64 clients hold half-sent bodies, one stream runs past the grace
    period; SIGTERM ends the stream with an error event, answers the 64 with a
    503, and the server and its ranks are gone within the documented bound."""
    assert server.wait_idle()["ctxpar:kv_cache_usage_perc"] == 0  # after everything above: all blocks free
    socks = [send_half(server.url, "/v1/completions", {"prompt": f"half {i}", "max_tokens": 2}) for i in range(64)]
    for s in socks[:32]:
        s.close()  # half of them leave; the others stay, silent
    body = {"prompt": "long", "max_tokens": 500, "ignore_eos": True, "stream": True, "n": 8, "temperature": 1.0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = [x for x in lines if x]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    errors = [json.loads(x[6:])["error"] for x in rest if x.startswith("data: {") and "error" in x]
    assert not errors or "shutting down" in errors[0]["message"]  # finished in time, or ended with the reason
    answers = [read_response(s, timeout=GRACE_S + STOP_MARGIN_S) for s in socks[32:]]
    assert {status for status, _, _ in answers} == {503}
    # It exits on its own: stop() would send a second signal, which means "exit now".
    server.proc.wait(timeout=GRACE_S + STOP_MARGIN_S)
    assert server.stop() in STOPPED  # checks no rank outlives it
    assert time.monotonic() - t0 < GRACE_S + STOP_MARGIN_S
    assert "Traceback" not in server.log()
