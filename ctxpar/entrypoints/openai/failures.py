"""What a client is told when the server itself fails (a 500): that it failed, where,
and a request id to find it by in the server's log, never the exception's text.

An exception's text can carry file paths, configuration values or another
request's data; the log (stderr) gets it whole, with the traceback, under the
same request id.
"""

from __future__ import annotations

import logging
import uuid

from ctxpar.entrypoints.openai.protocol import ApiError

logger = logging.getLogger("ctxpar")


def internal_error(method: str, path: str, e: BaseException) -> ApiError:
    """The 500 of ``e``, raised serving ``method path``; logged, traceback and all, with its request id."""
    rid = uuid.uuid4().hex[:16]
    where = f"{method} {path}"
    logger.error("request %s: %s failed", rid, where, exc_info=(type(e), e, e.__traceback__))
    message = f"internal server error in {where} ({type(e).__name__}); the server's log has the details under {rid}"
    return ApiError(500, message, headers={"X-Request-Id": rid})
