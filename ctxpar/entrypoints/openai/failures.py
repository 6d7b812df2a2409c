"""What a client is told when the server itself fails (a 500), or when the chat
template fails on its messages (a 400): that it failed, where, and a request id to
find it by in the server's log, never the exception's text.

An exception's text can carry file paths, configuration values or another
request's data; the log (stderr) gets it whole, with the traceback, under the
same request id. The one exception passed on is a chat template's own refusal
(its ``raise_exception``: a jinja2 TemplateError of that class exactly, whose
text the template's author wrote for clients, e.g. "roles must alternate").
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


def template_error(e: Exception) -> ApiError:
    """The 400 of a chat template that failed to render the messages."""
    if _is_template_refusal(e):
        return ApiError(400, f"the chat template refused the messages: {e}", param="messages")
    rid = uuid.uuid4().hex[:16]
    logger.warning("request %s: the chat template failed", rid, exc_info=(type(e), e, e.__traceback__))
    message = (
        f"the chat template could not render the messages ({type(e).__name__}): check their roles, order and "
        f"content; the server's log has the details under {rid}"
    )
    return ApiError(400, message, param="messages", headers={"X-Request-Id": rid})


def _is_template_refusal(e: Exception) -> bool:
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:
        return False
    return type(e) is TemplateError  # its subclasses are jinja's own errors (syntax, undefined names)
