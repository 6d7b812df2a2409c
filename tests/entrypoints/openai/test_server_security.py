"""`ctxpar serve` against clients that attack it (issue 39, finding 4): each test does
what the attacker would and asserts that it fails, fast and with a clear answer.

- no key, a declared 16 MiB body: 401 before a byte of the body is sent;
- bodies held open together past --max-body-bytes-in-flight: 503, not memory;
- prompts x n past the per-request limits: 400 naming the flag;
- many distinct grammars: the cache stays within --grammar-cache-bytes
  (tests/engine/test_grammar_cache.py: 10,000 schemas), a slow one a 408;
- /openapi.json, /docs: 404 unless --enable-docs; /metrics: 401 without the key;
- a 500 says where it failed and a request id, not the exception's text;
- a server without a key warns (on a non-loopback --host: open to the network).

The server is the tiny test model with a byte tokenizer; a sitecustomize on its
PYTHONPATH makes the model name "boom" raise inside a route (a bug on demand).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from helpers.raw_http import connect, read_response, request_head
from helpers.server_harness import STOPPED, Server
from helpers.tiny_tokenizer import with_byte_tokenizer

pytestmark = pytest.mark.multiprocess  # server processes

KEY = "s3cret-test-key"
NAME = "tiny"
SECRET = "SECRET-DETAIL /home/operator/.config/token=hunter2"
MAX_BODY = 512 << 10  # room for the slow schema below
BUDGET = 2 * MAX_BODY
BUG = f"""
import ctxpar.entrypoints.openai.app as app

_check = app.ServerState.check_model


def check_model(self, name):
    if name == "boom":
        raise RuntimeError({SECRET!r})
    return _check(self, name)


app.ServerState.check_model = check_model
"""


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    out = with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("security") / "llama")
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = 0  # structured outputs need one to end a structure
    (out / "config.json").write_text(json.dumps(config))
    return out


def start(model_dir, tmp_path_factory, extra: list[str], api_key: str | None, bug: bool = False) -> Server:
    args = ["--model", str(model_dir), "--served-model-name", NAME, "--threads", "1", "--kv-cache-blocks", "256"]
    log = tmp_path_factory.mktemp("security_log") / "server.log"
    with pytest.MonkeyPatch.context() as mp:
        if bug:
            site = tmp_path_factory.mktemp("bug")
            (site / "sitecustomize.py").write_text(BUG)
            mp.setenv("PYTHONPATH", str(site))
        return Server(args + extra, api_key=api_key, log=log)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    limits = ["--max-body-size", str(MAX_BODY), "--max-body-bytes-in-flight", str(BUDGET)]
    limits += ["--max-prompts-per-request", "4", "--max-sequences-per-request", "8"]
    limits += ["--grammar-cache-bytes", "20000", "--grammar-compile-timeout", "0.25"]
    s = start(model_dir, tmp_path_factory, limits, api_key=KEY, bug=True)
    yield s
    assert s.stop() in STOPPED, s.log()


def post(server, path: str, body: dict, key: bool = True) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers() if key else {}, timeout=60)


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and all(w in err["message"] for w in words), err
    return err


@pytest.mark.parametrize("declared", [16 << 20, MAX_BODY - 1])
def test_no_key_is_a_401_before_the_body_is_sent(server, declared):
    """Headers only, a body declared (16 MiB: past the size limit; or within it): the
    answer is a 401 at once, not a wait for a body the server would have buffered."""
    s = connect(server.url)
    try:
        t0 = time.monotonic()
        s.sendall(request_head("/v1/completions", declared))
        status, headers, body = read_response(s, timeout=5)
        assert time.monotonic() - t0 < 2
    finally:
        s.close()
    assert status == 401 and "API key" in json.loads(body)["error"]["message"], body
    assert headers["connection"] == "close" and headers["www-authenticate"] == "Bearer"


def test_wrong_key_is_a_401_for_every_path_but_health(server):
    for path in ("/v1/models", "/tokenize", "/metrics", "/no-such-path", "/openapi.json"):
        r = httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}, timeout=60)
        assert r.status_code == 401, (path, r.text)
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key=KEY + "x", max_retries=0).models.list()


def test_bodies_in_flight_past_the_budget_are_a_503(server):
    """Two authenticated clients declare the largest body and send none of it: they
    hold the whole budget, so a third body is refused at once, never buffered."""
    auth = {"Authorization": f"Bearer {KEY}"}
    holders = [connect(server.url) for _ in range(BUDGET // MAX_BODY)]
    try:
        for h in holders:
            h.sendall(request_head("/v1/completions", MAX_BODY, auth))
        time.sleep(0.5)  # the server has read their headers
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert_error(r, 503, "--max-body-bytes-in-flight", str(BUDGET))
        assert r.headers["retry-after"] == "1"
    finally:
        for h in holders:
            h.close()
    deadline = time.monotonic() + 10
    while (r := post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})).status_code == 503:
        assert time.monotonic() < deadline, r.text  # the closed connections give their bytes back
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_too_many_prompts_or_sequences_are_a_400(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--max-prompts-per-request"):
        client.completions.create(model=NAME, prompt=["a"] * 5, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="--max-sequences-per-request") as e:
        client.completions.create(model=NAME, prompt=["a", "b"], n=5, max_tokens=1, temperature=1.0)
    assert "2 prompt(s) x n=5 = 10 sequences" in str(e.value) and "at most 8" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="best_of=9"):
        client.completions.create(model=NAME, prompt="a", n=2, best_of=9, max_tokens=1, temperature=1.0)
    with pytest.raises(openai.BadRequestError, match="--max-sequences-per-request"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], n=9, max_tokens=1, temperature=1.0
        )
    r = client.completions.create(model=NAME, prompt=["a", "b"], n=4, max_tokens=1, temperature=1.0)
    assert len(r.choices) == 8  # at the limit: served


def test_many_grammars_are_served_from_a_bounded_cache(server):
    """Distinct regexes, each a compile cached in the server; with a 20 KB bound each is
    served all the same (evicted ones compile again), the same answer for the same one."""
    outs = {}
    for i in list(range(12)) + [0, 1]:
        body = {"prompt": "x", "max_tokens": 8, "temperature": 0, "guided_regex": f"{i}[ab]{{3}}"}
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert text.startswith(str(i)) and len(text) == len(str(i)) + 3, text
        assert outs.setdefault(i, text) == text


def test_a_grammar_past_the_compile_timeout_is_a_408(server):
    """A schema that takes seconds to compile (thousands of patterned properties) gets a
    408 after the server's 0.25 s, and the server goes on serving."""
    properties = {f"p{i}": {"type": "string", "pattern": f"^x{i}[a-z]{{2,9}}$"} for i in range(3000)}
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_json": schema})
    assert_error(r, 408, "--grammar-compile-timeout", "0.25 s")
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_docs_are_off_by_default(server):
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(server.url + path, headers=server.headers(), timeout=60).status_code == 404, path


def test_tokenize_needs_the_key_and_its_admission(server):
    assert post(server, "/tokenize", {"prompt": "abc"}, key=False).status_code == 401
    r = post(server, "/tokenize", {"prompt": "abc"})
    assert r.status_code == 200 and r.json()["count"] >= 3, r.text
    r = post(server, "/detokenize", {"tokens": r.json()["tokens"]})
    assert r.status_code == 200 and "abc" in r.json()["prompt"], r.text


def test_a_500_names_the_failure_not_the_exception_text(server):
    r = post(server, "/v1/completions", {"model": "boom", "prompt": "x"})
    err = assert_error(r, 500, "POST /v1/completions", "RuntimeError")
    rid = r.headers["x-request-id"]
    assert SECRET not in r.text and "hunter2" not in r.text and rid in err["message"]
    time.sleep(0.2)
    log = server.log_path.read_text()
    assert f"request {rid}: POST /v1/completions failed" in log and f"RuntimeError: {SECRET}" in log
    assert log.count(f"RuntimeError: {SECRET}") == 1  # logged once, with the id (not again by uvicorn)
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_docs_and_metrics_made_public_by_their_flags(model_dir, tmp_path_factory):
    s = start(model_dir, tmp_path_factory, ["--enable-docs", "--public-metrics"], api_key=KEY)
    try:
        r = httpx.get(s.url + "/openapi.json", timeout=60)
        assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]
        assert httpx.get(s.url + "/docs", timeout=60).status_code == 200
        assert httpx.get(s.url + "/metrics", timeout=60).status_code == 200
        assert httpx.get(s.url + "/v1/models", timeout=60).status_code == 401  # the API still needs the key
    finally:
        assert s.stop() in STOPPED, s.log()


def test_a_server_open_to_the_network_without_a_key_warns(tmp_path):
    """The warning comes before the model loads (here a missing one: the server never
    binds); with a key from the environment, or on loopback, there is none; a key
    on the command line gets a warning of its own."""

    def serve(*args: str, key: str | None = None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "CTXPAR_API_KEY"}
        if key is not None:
            env["CTXPAR_API_KEY"] = key
        cmd = [sys.executable, "-m", "ctxpar.cli", "serve", "--model", str(tmp_path / "missing"), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2, r.stderr
        return r.stderr

    err = serve("--host", "0.0.0.0")
    assert "warning: serving on 0.0.0.0 without an API key" in err and "CTXPAR_API_KEY" in err
    assert "warning" not in serve("--host", "0.0.0.0", key=KEY)
    for loopback in ("127.0.0.1", "::1"):  # this machine's users and web pages (issue 52)
        err = serve("--host", loopback)
        assert "warning: serving on" in err and "every user and process of this machine" in err
    assert "warning" not in serve("--host", "127.0.0.1", key=KEY)
    err = serve("--host", "0.0.0.0", "--api-key", KEY)  # a key all the same, but in /proc for all to read
    assert "without an API key" not in err and "--api-key on the command line is readable" in err
