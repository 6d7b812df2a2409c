"""GET /health: what a load balancer or an operator needs to know, in one JSON body.

- "healthy" (200): serving.
- "degraded" (200): serving, but at its limits: new generation requests are
  refused with 503 + Retry-After until a slot or queue place frees; or
  serving on fewer PCP ranks than configured, a lost rank having failed to
  come back (restart the server to get them all again).
- "recovering" (200): a lost PCP rank is being respawned and the KV of the
  requests in flight restored; they continue afterwards, new ones wait
  (the engine thread checks the ranks at every idle wake-up: a spawned rank's
  process, a torchrun rank's heartbeat; so a rank killed between requests is
  found within a second, or about 3 s under torchrun, not by the next request).
- "dead" (503): the engine failed (a rank lost beyond --max-rank-recoveries,
  or one that cannot be respawned). The body carries the reason in OpenAI's
  error shape (a lost rank's own account; of any other failure only its
  kind, the server's log has the exception); restart the server.

A request without the API key (a load balancer's probe) gets the status
alone: the counts and the reason say how busy and how broken the server is,
which is the key holders' business.
"""

from __future__ import annotations

from ctxpar.engine.async_llm import AsyncLLM
from ctxpar.entrypoints.openai.limits import Admission
from ctxpar.entrypoints.openai.protocol import ApiError


def report(engine: AsyncLLM, admission: Admission, full: bool) -> tuple[int, dict]:
    """(HTTP status, body) of /health; ``full``: with the counts and the reason (the key was given)."""
    status, body = _report(engine, admission)
    return status, body if full else {"status": body["status"]}


def _report(engine: AsyncLLM, admission: Admission) -> tuple[int, dict]:
    recovery = engine.rank_recovery
    counts = {
        "requests_running": admission.running,
        "requests_queued": admission.queued,
        "rank_failures": recovery.rank_failures,
        "rank_recoveries": recovery.recoveries,
        "pcp_ranks": recovery.pcp_ranks,
    }
    dead = engine.dead_error
    if dead is not None:
        return 503, {"status": "dead", **counts, **ApiError(503, str(dead)).body()}
    if recovery.recovering:
        return 200, {"status": "recovering", **counts, "message": "a lost PCP rank is being replaced"}
    if recovery.pcp_ranks < recovery.pcp_size:
        message = f"serving on {recovery.pcp_ranks} of {recovery.pcp_size} PCP ranks: a lost rank could not come back"
        return 200, {"status": "degraded", **counts, "message": message}
    if admission.full():
        return 200, {"status": "degraded", **counts, "message": "at its limits: new requests get 503 + Retry-After"}
    return 200, {"status": "healthy", **counts}
