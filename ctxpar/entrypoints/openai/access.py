"""Who may call what: the API key, checked on a request's headers alone.

ClientGuard (guard.py) asks ``Access.refuse`` before it reads a byte of the
body or admits anything, so a client without the key costs the server one
header parse and a 401 (and the connection is closed: its body is never read).

With a key, every path needs it except /health (load balancers probe it
without credentials), /metrics with ``public_metrics`` (Prometheus scrapers),
and the API docs with ``enable_docs`` (a browser sends no Bearer header; they
describe the API's shape, nothing of its data). Without a key everything is
open, which is why ``ctxpar serve`` warns when it listens beyond loopback
without one.
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

    def public_paths(self) -> frozenset[str]:
        paths = {"/health"}
        if self.public_metrics:
            paths.add("/metrics")
        if self.enable_docs:
            paths.update(DOCS_PATHS)
        return frozenset(paths)

    def refuse(self, scope: Mapping[str, Any]) -> ApiError | None:
        """A 401 for an HTTP request without the key to its path; None if it may go on."""
        if self.api_key is None or scope["path"] in self.public_paths():
            return None
        given = dict(scope["headers"]).get(b"authorization", b"")
        # Constant time: how long the comparison took says nothing of how much of the key was right.
        if hmac.compare_digest(given, b"Bearer " + self.api_key.encode()):
            return None
        return ApiError(
            401,
            "invalid or missing API key: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server to this machine ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def startup_warnings(host: str, access: Access, key_from_environment: bool) -> list[str]:
    """What ``ctxpar serve`` warns about before it starts: a server open to the network
    without a key, and a key given on the command line (readable by every local user)."""
    warnings = []
    if access.api_key is None and not is_loopback(host):
        warnings.append(
            f"warning: serving on {host} without an API key: anyone who can reach this port can use the model. "
            "Set CTXPAR_API_KEY in the environment, or bind --host 127.0.0.1"
        )
    if access.api_key is not None and not key_from_environment:
        warnings.append(
            "warning: --api-key on the command line is readable by every user of this machine "
            "(/proc/<pid>/cmdline, ps): set CTXPAR_API_KEY in the environment instead"
        )
    return warnings
