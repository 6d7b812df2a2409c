"""GET /health: what a load balancer or an operator needs to know, in one JSON body.

- "healthy" (200): serving.
- "degraded" (200): serving, but at its limits: new generation requests are
  refused with 503 + Retry-After until a slot or queue place frees.
- "dead" (503): the engine failed (e.g. a PCP rank was lost; the engine
  thread checks the spawned ranks at every idle wake-up, so a rank killed
  between requests is reported within a second, not by the next request).
  The body carries the reason in OpenAI's error shape; restart the server.
"""

from __future__ import annotations

from ctxpar.engine.async_llm import AsyncLLM
from ctxpar.entrypoints.openai.limits import Admission
from ctxpar.entrypoints.openai.protocol import ApiError


def report(engine: AsyncLLM, admission: Admission) -> tuple[int, dict]:
    """(HTTP status, body) of /health."""
    counts = {
        "requests_running": admission.running,
        "requests_queued": admission.queued,
        "rank_failures": engine.num_rank_failures,
    }
    dead = engine.dead_error
    if dead is not None:
        return 503, {"status": "dead", **counts, **ApiError(503, str(dead)).body()}
    if admission.full():
        return 200, {"status": "degraded", **counts, "message": "at its limits: new requests get 503 + Retry-After"}
    return 200, {"status": "healthy", **counts}
