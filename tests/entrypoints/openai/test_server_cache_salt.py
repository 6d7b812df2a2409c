"""``cache_salt`` on the server's two generation endpoints: a tenant sending
another tenant's prompt under its own salt finds none of it in the prefix cache
(its time to first token cannot tell it what others asked); the same salt
shares, as does sending none. Hits are read from the server's
``ctxpar:prefix_cache_hits`` counter (vLLM's prefix_cache_hits)."""

from __future__ import annotations

import httpx
import pytest

from helpers.server_harness import STOPPED, Server
from helpers.tiny_tokenizer import with_byte_tokenizer

pytestmark = pytest.mark.multiprocess  # starts a server

KEY = "test-key"
SECRET = "the secret plan of tenant A: " + "x" * 120  # far more than one 16-token block


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    model = with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("salt") / "llama")
    s = Server(
        ["--model", str(model), "--threads", "1", "--kv-cache-blocks", "256"],
        api_key=KEY,
        log=tmp_path_factory.mktemp("salt_log") / "server.log",
    )
    yield s
    assert s.stop() in STOPPED, s.log()
    assert "Traceback" not in s.log()


def hits(server: Server, path: str, body: dict, salt: str | None) -> float:
    """Prompt tokens the request found in the prefix cache."""
    before = server.wait_idle()["ctxpar:prefix_cache_hits_total"]
    body = {**body, "max_tokens": 1, "temperature": 0} | ({"cache_salt": salt} if salt is not None else {})
    r = httpx.post(server.url + path, json=body, headers=server.headers(), timeout=300)
    assert r.status_code == 200, r.text
    return server.wait_idle()["ctxpar:prefix_cache_hits_total"] - before


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": SECRET}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET}]}),
    ],
)
def test_salts_isolate_tenants_on_both_endpoints(server, path, body) -> None:
    tag = path.rsplit("/", 1)[-1]
    assert hits(server, path, body, f"{tag}-a") == 0
    assert hits(server, path, body, f"{tag}-b") == 0  # tenant B probes A's prompt: nothing cached
    assert hits(server, path, body, None) == 0  # nor without a salt
    assert hits(server, path, body, f"{tag}-a") > 0  # A's own requests share
    assert hits(server, path, body, None) > 0  # unsalted requests share with each other, as before


def test_an_empty_salt_is_a_400(server) -> None:
    body = {"prompt": "hi", "max_tokens": 1, "cache_salt": ""}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
