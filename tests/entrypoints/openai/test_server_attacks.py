"""`ctxpar serve` against the attacks of issue 52 (server side): each test does what the
attacker would and asserts that it is refused or bounded, fast.

- 100,000 stop strings, bad words, token ids or logit_bias entries: a 400 naming the bound;
  1,024 stop strings are served, matched by one automaton;
- a request line then one header line at a time (slowloris): closed at --timeout-header;
  past --max-connections, a connection is closed as it comes;
- a text/plain or form POST (what a web page may send unasked): 415;
- Host: evil.example on a server without a key (DNS rebinding): 421;
- a spec over --max-grammar-bytes: 400; one that compiles for seconds: 408 at the
  timeout, its compiler process killed, while a normal request is served meanwhile;
- prompt_logprobs past --max-logprob-entries: 400;
- a chat template that fails: a 400 with a request id, never the exception's text
  (a template's own raise_exception message is passed on);
- /health and /metrics without the key: the status alone, no prefix-cache counts;
- unseeded requests: the first request of two fresh servers differ (OS randomness);
  seeded ones are identical.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from helpers.raw_http import connect
from helpers.server_harness import STOPPED, Server
from helpers.tiny_tokenizer import with_byte_tokenizer

pytestmark = pytest.mark.multiprocess  # server processes

KEY = "s3cret-test-key"
HEADER_S = 1.0
CONNECTIONS = 12
PROBE = {"prompt": "The", "max_tokens": 12, "temperature": 1.0}
# The byte tokenizer's template, but a "refuse" message is refused on purpose (raise_exception, a
# message for the client) and a "crash" one fails inside jinja (a TypeError: internals).
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'refuse' %}{{ raise_exception('roles must alternate') }}"
    "{% elif m['role'] == 'crash' %}{{ m['content'] / 2 }}"
    "{% else %}<{{ m['role'] }}>{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    out = with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("attacks") / "llama")
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = 0  # structured outputs need one to end a structure
    (out / "config.json").write_text(json.dumps(config))
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(TEMPLATE)
    else:
        tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
        tokenizer_config["chat_template"] = TEMPLATE
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out


def start(model_dir, tmp_path_factory, extra: list[str], api_key: str | None) -> tuple[Server, str]:
    """A server, and the text of its first generation request (unseeded)."""
    args = ["--model", str(model_dir), "--threads", "1", "--kv-cache-blocks", "256", *extra]
    s = Server(args, api_key=api_key, log=tmp_path_factory.mktemp("attacks_log") / "server.log")
    r = httpx.post(s.url + "/v1/completions", json=PROBE, headers=s.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return s, r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def open_server(model_dir, tmp_path_factory):
    """No key; short header deadline, few connections, a quick grammar timeout, few logprobs."""
    extra = ["--timeout-header", str(HEADER_S), "--max-connections", str(CONNECTIONS)]
    extra += ["--grammar-compile-timeout", "1", "--max-grammar-bytes", "200000", "--max-logprob-entries", "1000"]
    s, first = start(model_dir, tmp_path_factory, extra, api_key=None)
    s.first_text = first
    yield s
    assert s.stop() in STOPPED, s.log()


@pytest.fixture(scope="module")
def keyed_server(model_dir, tmp_path_factory):
    s, first = start(model_dir, tmp_path_factory, ["--public-metrics"], api_key=KEY)
    s.first_text = first
    yield s
    assert s.stop() in STOPPED, s.log()


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers(), timeout=120)


def assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("stop", [f"s{i:07d}" for i in range(100_000)], ["stop has 100000 strings", "at most 1024"]),
        ("bad_words", [f"w{i:07d}" for i in range(100_000)], ["bad_words has 100000 strings", "at most 256"]),
        ("stop", ["x" * 20_000], ["stop has 20000 characters", "at most 16384"]),
        ("stop_token_ids", list(range(100_000)), ["stop_token_ids has 100000", "at most 1024"]),
        ("allowed_token_ids", list(range(100_000)), ["allowed_token_ids has 100000", "at most 4096"]),
        ("logit_bias", {str(i): 1.0 for i in range(100_000)}, ["logit_bias has 100000 entries", "at most 1024"]),
    ],
)
def test_huge_lists_are_a_400_naming_the_bound(open_server, field, value, words):
    t0 = time.monotonic()
    r = post(open_server, {**PROBE, field: value})
    assert_error(r, 400, *words)
    assert time.monotonic() - t0 < 10


def test_a_thousand_stop_strings_are_matched(open_server):
    """1,024 stop strings, one of them every letter: the text stops at its first letter."""
    stops = [f"zz{i:05d}" for i in range(1020)] + list("abcd")
    first = post(open_server, {**PROBE, "seed": 3, "max_tokens": 16})
    r = post(open_server, {**PROBE, "seed": 3, "max_tokens": 16, "stop": stops})
    assert r.status_code == 200, r.text
    whole, cut = first.json()["choices"][0]["text"], r.json()["choices"][0]["text"]
    at = min((whole.find(c) for c in "abcd" if c in whole), default=len(whole))
    assert whole.startswith(cut) and len(cut) <= at, (whole, cut)


def test_slowloris_is_closed_at_the_header_deadline(open_server):
    """A request line, then one header line every 0.3 s: the connection is closed at
    --timeout-header, not held for as long as the client keeps sending."""
    s = connect(open_server.url)
    s.settimeout(0.3)
    t0 = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    received = b""
    try:
        for i in range(40):
            try:
                s.sendall(f"X-Slow-{i}: x\r\n".encode())
                chunk = s.recv(4096)
            except TimeoutError:
                continue
            except OSError:  # reset: the server closed while this client was still sending
                break
            if not chunk:
                break
            received += chunk
    finally:
        s.close()
    elapsed = time.monotonic() - t0
    assert received == b"" or received.startswith(b"HTTP/1.1 408"), received
    assert HEADER_S - 0.1 < elapsed < HEADER_S + 3, elapsed


def test_a_request_line_alone_gets_a_408(open_server):
    s = connect(open_server.url)
    try:
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\n")
        s.settimeout(HEADER_S + 5)
        received = s.recv(4096)
        assert s.recv(4096) == b""  # and closed
    finally:
        s.close()
    assert received.startswith(b"HTTP/1.1 408"), received
    assert HEADER_S - 0.1 < time.monotonic() - t0 < HEADER_S + 3


def test_connections_past_the_limit_are_closed(open_server):
    held = [connect(open_server.url) for _ in range(CONNECTIONS)]
    try:
        time.sleep(0.2)
        extra = connect(open_server.url)
        extra.settimeout(HEADER_S / 2)  # before the held ones' header deadline
        try:
            assert extra.recv(100) == b""  # closed at once
        except ConnectionResetError:
            pass
        finally:
            extra.close()
    finally:
        for h in held:
            h.close()
    time.sleep(0.3)
    assert post(open_server, {**PROBE, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
)
def test_a_post_not_declared_json_is_a_415(open_server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(open_server.url + "/v1/completions", content=json.dumps(PROBE), headers=headers, timeout=60)
    assert_error(r, 415, "application/json")


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "attacker.localhost"])
def test_a_foreign_host_is_refused_without_a_key(open_server, host):
    r = httpx.post(open_server.url + "/v1/completions", json=PROBE, headers={"Host": host}, timeout=60)
    assert_error(r, 421, "Host", "CTXPAR_API_KEY")
    assert httpx.get(open_server.url + "/v1/models", headers={"Host": host}, timeout=60).status_code == 421


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]"])
def test_a_local_host_is_served_without_a_key(open_server, host):
    port = open_server.url.rsplit(":", 1)[1]
    r = httpx.post(open_server.url + "/v1/completions", json=PROBE, headers={"Host": f"{host}:{port}"}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_spec_over_the_size_cap_is_a_400(open_server):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
    t0 = time.monotonic()
    assert_error(post(open_server, {**PROBE, "guided_json": schema}), 400, "--max-grammar-bytes", "200000")
    assert time.monotonic() - t0 < 10


def test_a_slow_spec_is_killed_at_the_timeout_while_others_are_served(open_server):
    """A schema that compiles for seconds gets a 408 at the 1 s timeout; a normal request
    sent meanwhile is served in the usual time, and the next grammar compiles."""
    properties = {f"p{i}": {"type": "string", "pattern": f"^x{i}[a-z]{{2,9}}$"} for i in range(2500)}
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    post(open_server, {**PROBE, "max_tokens": 2, "guided_choice": ["warm"]})  # the compiler's process started
    t0 = time.monotonic()
    normal = post(open_server, {**PROBE, "max_tokens": 4})
    usual = time.monotonic() - t0
    results: dict[str, httpx.Response] = {}
    attack = threading.Thread(target=lambda: results.update(slow=post(open_server, {**PROBE, "guided_json": schema})))
    t0 = time.monotonic()
    attack.start()
    time.sleep(0.2)
    normal = post(open_server, {**PROBE, "max_tokens": 4})
    during = time.monotonic() - t0 - 0.2
    attack.join()
    assert normal.status_code == 200 and during < usual + 2, (during, usual)
    assert_error(results["slow"], 408, "--grammar-compile-timeout")
    deadline = time.monotonic() + 30
    # Its process killed, the compiler's next one starts (importing xgrammar: a second or two).
    while (r := post(open_server, {**PROBE, "max_tokens": 4, "guided_choice": ["yes", "no"]})).status_code == 408:
        assert time.monotonic() < deadline, r.text
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text


def test_prompt_logprobs_past_the_output_bound_are_a_400(open_server):
    r = post(open_server, {"prompt": "x" * 100, "max_tokens": 1, "prompt_logprobs": 20})
    assert_error(r, 400, "--max-logprob-entries", "1000")
    assert post(open_server, {"prompt": "x" * 10, "max_tokens": 1, "prompt_logprobs": 5}).status_code == 200


def test_health_and_public_metrics_without_the_key_say_little(keyed_server):
    r = httpx.get(keyed_server.url + "/health", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "healthy"}, r.text
    full = httpx.get(keyed_server.url + "/health", headers=keyed_server.headers(), timeout=60).json()
    assert full["status"] == "healthy" and "requests_running" in full
    public = httpx.get(keyed_server.url + "/metrics", timeout=60).text
    private = httpx.get(keyed_server.url + "/metrics", headers=keyed_server.headers(), timeout=60).text
    assert "ctxpar:prefix_cache_hits" not in public and "ctxpar:generation_tokens" in public
    assert "ctxpar:prefix_cache_hits" in private


def test_unseeded_requests_are_not_predictable_seeded_ones_are_the_same(open_server, keyed_server):
    """The first request after a start drew from seed 0 and arrival 0 before: two fresh
    servers gave the same text. From the OS's randomness they differ; seeded requests
    are identical on both."""
    assert open_server.first_text != keyed_server.first_text
    seeded = [post(s, {**PROBE, "seed": 11}).json()["choices"][0]["text"] for s in (open_server, keyed_server)]
    assert seeded[0] == seeded[1]


def test_a_failing_chat_template_answers_no_exception_text(open_server):
    def chat(role: str) -> httpx.Response:
        body = {"messages": [{"role": role, "content": "SECRET-CONTENT"}], "max_tokens": 2}
        return post(open_server, body, "/v1/chat/completions")

    r = chat("crash")
    assert_error(r, 400, "could not render the messages (TypeError)", r.headers["x-request-id"])
    assert "unsupported operand" not in r.text and "SECRET" not in r.text
    time.sleep(0.2)
    assert "unsupported operand" in open_server.log()  # the log has it, under the request id
    assert_error(chat("refuse"), 400, "the chat template refused the messages: roles must alternate")
    assert chat("user").status_code == 200
