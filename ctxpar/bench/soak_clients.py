"""The soak's clients: each draws a random request from a mix, sends it over
loopback, and classifies what came back against what that request should get.

The mix: completions and chat, streamed or not, prompts of 5..max_words words,
1..max_tokens tokens, sometimes n=2, logprobs or sampling with a seed; a
share of clients that leave early (a stream after a few events, a plain
request after a fraction of a second); and a share of bad requests
(malformed, truncated or non-UTF-8 JSON, huge n or max_tokens, an oversized
prompt), which must each get a 400.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from dataclasses import dataclass

WORDS = "the a context parallel rank token cache prompt model stream server request long short quick brown fox".split()

BAD_BODIES: list[bytes] = [
    b'{"prompt": "x", max_tokens: 3}',
    b'{"prompt": "the quick brown',
    b'{"prompt": "\xff\xfe\xfa"}',
    b'{"prompt": "x", "n": 1000000000}',
    b'{"prompt": "x", "max_tokens": 1000000000000}',
    json.dumps({"prompt": "context " * 20000}).encode(),  # more tokens than the context holds
]


@dataclass(frozen=True)
class Planned:
    """One request and what it should get."""

    path: str
    body: bytes
    stream: bool
    expect: str  # "ok", or "refused" (a 400)
    leave_after: int | None  # a leaving client: events read (streams) before closing; 0: closes a plain one


@dataclass(frozen=True)
class Outcome:
    kind: str  # "ok", "left" (the client's own abort), "refused" (an expected 400), else an error's name
    latency: float | None = None  # seconds, of the "ok" ones


def plan(rng: random.Random, max_words: int, max_tokens: int, abort_rate: float, bad_rate: float) -> Planned:
    """A random request of the mix."""
    draw = rng.random()
    if draw < bad_rate:
        return Planned("/v1/completions", rng.choice(BAD_BODIES), False, "refused", None)
    leaving = draw < bad_rate + abort_rate
    stream = leaving or rng.random() < 0.5
    text = " ".join(rng.choices(WORDS, k=rng.randint(min(5, max_words), max_words)))
    fields: dict = {"max_tokens": rng.randint(1, max_tokens), "stream": stream}
    if rng.random() < 0.5:
        fields.update(temperature=0.8, seed=rng.randint(0, 1 << 30), n=rng.choice([1, 1, 2]))
    else:
        fields["temperature"] = 0
    if rng.random() < 0.5:
        path, body = "/v1/completions", {"prompt": text, **fields}
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 5)
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], **fields}
    leave_after = (rng.randint(1, 5) if stream else 0) if leaving else None
    return Planned(path, json.dumps(body).encode(), stream, "ok", leave_after)


def send(host: str, port: int, p: Planned, timeout: float) -> Outcome:
    """Send one planned request and classify its answer."""
    conn = http.client.HTTPConnection(host, port, timeout=0.3 if p.leave_after == 0 else timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", p.path, p.body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if p.expect == "refused":
            return Outcome("refused" if resp.status == 400 and _is_error(resp.read()) else f"bad got {resp.status}")
        if resp.status != 200:
            return Outcome(f"http {resp.status}")
        if not p.stream:
            body = json.loads(resp.read())
            return Outcome("ok", time.perf_counter() - t0) if body.get("choices") else Outcome("empty answer")
        return _read_stream(resp, p.leave_after, t0)
    except TimeoutError:
        return Outcome("left" if p.leave_after == 0 else "timeout")  # a plain request's client gave up: on purpose
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Outcome(type(e).__name__)
    finally:
        conn.close()


def _read_stream(resp: http.client.HTTPResponse, leave_after: int | None, t0: float) -> Outcome:
    events = 0
    while line := resp.readline():
        if line.strip() == b"data: [DONE]":
            return Outcome("ok", time.perf_counter() - t0)
        if line.startswith(b"data: "):
            if b'"error"' in line:
                return Outcome("error event")
            events += 1
            if leave_after is not None and events >= leave_after:
                return Outcome("left")  # the connection closes mid-stream
    return Outcome("left" if leave_after is not None else "stream cut")


def _is_error(body: bytes) -> bool:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and {"message", "type", "code"} <= set(err)
