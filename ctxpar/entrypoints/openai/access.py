"""Who may call what: the API key, checked on a request's headers alone.

ClientGuard (guard.py) asks ``Access.refuse`` before it reads a byte of the
body or admits anything, so a client without the key costs the server one
header parse and a 401 (and the connection is closed: its body is never read).

With a key, every path needs it except /health (load balancers probe it
without credentials; they get its status alone), /metrics with
``public_metrics`` (Prometheus scrapers; the prefix cache's counts are left
out for them), and the API docs with ``enable_docs`` (a browser sends no Bearer
header; they describe the API's shape, nothing of its data).

Without a key everything is open to whoever can connect, and that includes web
pages in the browsers of this machine's users: a page may POST to a loopback
port. So a server without a key answers only requests whose Host is an IP
address, localhost or the name it was bound to (a page that rebinds its own DNS
name to 127.0.0.1 still sends that name), and ClientGuard takes only JSON bodies
(a page may send text/plain or a form without asking, but not JSON). ``ctxpar
serve`` warns whenever it serves without a key.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ctxpar.entrypoints.openai.protocol import ApiError

DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


@dataclass(frozen=True)
class Access:
    """The API key (None: open) and the paths it does not guard."""

    api_key: str | None = None
    enable_docs: bool = False  # serve /docs, /redoc and /openapi.json (without the key)
    public_metrics: bool = False  # /metrics without the key
    host: str = "127.0.0.1"  # the address bound: a Host header a server without a key answers

    def public_paths(self) -> frozenset[str]:
        paths = {"/health"}
        if self.public_metrics:
            paths.add("/metrics")
        if self.enable_docs:
            paths.update(DOCS_PATHS)
        return frozenset(paths)

    def authorized(self, scope: Mapping[str, Any]) -> bool:
        """Whether the request carries the key (always, on a server without one)."""
        if self.api_key is None:
            return True
        given = dict(scope["headers"]).get(b"authorization", b"")
        # Constant time: how long the comparison took says nothing of how much of the key was right.
        return hmac.compare_digest(given, b"Bearer " + self.api_key.encode())

    def refuse(self, scope: Mapping[str, Any]) -> ApiError | None:
        """A 401 for an HTTP request without the key to its path, a 421 for one to a server
        without a key addressed to another host; None if it may go on."""
        if self.api_key is None:
            return self._foreign_host(dict(scope["headers"]).get(b"host", b"").decode("latin-1"))
        if scope["path"] in self.public_paths() or self.authorized(scope):
            return None
        return ApiError(
            401,
            "invalid or missing API key: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def _foreign_host(self, host: str) -> ApiError | None:
        name = _host_name(host)
        if name.lower() in ("localhost", self.host.lower()) or _is_address(name):
            return None
        return ApiError(
            421,
            f"the Host header {host[:100]!r} is not this server's: a server without an API key answers only "
            "requests to an IP address, localhost or its --host (a web page's own name is refused: DNS "
            "rebinding); address it so, or serve with CTXPAR_API_KEY set",
        )


def _host_name(host: str) -> str:
    """A Host header's name, without its port ("[::1]:8000" -> "::1", "localhost:8000" -> "localhost")."""
    if host.startswith("["):
        return host[1 : host.find("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server to this machine ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def startup_warnings(host: str, access: Access, key_from_environment: bool) -> list[str]:
    """What ``ctxpar serve`` warns about before it starts: a server without a key (open to the
    network, or to this machine), and a key given on the command line (readable by every local user)."""
    warnings = []
    if access.api_key is None and not is_loopback(host):
        warnings.append(
            f"warning: serving on {host} without an API key: anyone who can reach this port can use the model. "
            "Set CTXPAR_API_KEY in the environment, or bind --host 127.0.0.1"
        )
    elif access.api_key is None:
        warnings.append(
            f"warning: serving on {host} without an API key: every user and process of this machine can use "
            "the model (web pages only by IP address or localhost, with JSON bodies). Set CTXPAR_API_KEY in "
            "the environment to keep it to those who hold the key"
        )
    if access.api_key is not None and not key_from_environment:
        warnings.append(
            "warning: --api-key on the command line is readable by every user of this machine "
            "(/proc/<pid>/cmdline, ps): set CTXPAR_API_KEY in the environment instead"
        )
    return warnings
