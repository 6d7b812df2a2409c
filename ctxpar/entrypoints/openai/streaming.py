"""A generation route's answer, from its Submission's outputs: collected whole
(``collect``) or streamed as server-sent events (``sse``). Either way a client
that disconnects aborts its requests: its ``http.disconnect`` ends the
submission's output iterator with ClientGone, and closing the iterator aborts
what is unfinished."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import cast

from fastapi import Request
from fastapi.responses import StreamingResponse

from ctxpar.engine.async_llm import EngineDeadError
from ctxpar.engine.submission import ClientGone, Submission
from ctxpar.entrypoints.openai import responses as R
from ctxpar.entrypoints.openai.protocol import MAX_REQUEST_ID_CHARS, ApiError, SamplingRequest
from ctxpar.errors import CtxparError
from ctxpar.outputs import RequestOutput

# A route's body of choice ``index`` (request output, the delta to send, sample number).
ChoiceFn = Callable[..., dict]


def usage(outs) -> dict:
    """The usage of the requests' final outputs, all together."""
    return R.usage(sum(len(o.prompt_token_ids) for o in outs), sum(len(c.token_ids) for o in outs for c in o.outputs))


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _outputs(sub: Submission, gone: asyncio.Future) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """``sub.outputs(gone)``, typed as what it is, an async generator (submission.py's annotation
    says AsyncIterator), so that aclosing may close it."""
    return cast(AsyncGenerator[tuple[int, RequestOutput], None], sub.outputs(gone))


async def collect(request: Request, sub: Submission) -> list:
    """The final output of each of the submission's requests, in order."""
    gone = asyncio.ensure_future(_wait_disconnect(request))
    final = {}
    try:
        # ClientGone if the client leaves; closing the iterator aborts what is unfinished.
        async with aclosing(_outputs(sub, gone)) as outputs:
            async for i, out in outputs:
                if out.finished:
                    final[i] = out
    finally:
        gone.cancel()
    return [final[i] for i in range(len(final))]


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def response_id(request: Request, req: SamplingRequest) -> str:
    """The id a response carries after its "cmpl-" or "chatcmpl-": the client's X-Request-Id
    header, else the body's request_id (vLLM's order), else a fresh one. The engine's own
    request ids stay the server's: two clients may well send the same label."""
    header = request.headers.get("x-request-id")
    if header is not None and 0 < len(header) <= MAX_REQUEST_ID_CHARS:
        return header
    return req.request_id or uuid.uuid4().hex


def sse(
    request: Request, sub: Submission, meta: tuple, choice: ChoiceFn, req: SamplingRequest, first: list[dict] | None
) -> StreamingResponse:
    """A server-sent-event response: ``first`` (if any) with the engine's first output, then
    chunks of each choice's new output (``choice`` makes a chunk's body; at least
    ``req.stream_interval`` tokens a chunk but the first and the last), then usage if asked
    (in every chunk too, with continuous_usage_stats: the choice's prompt and tokens so
    far), then [DONE]."""
    rid, obj, model, created = meta
    interval = req.stream_interval or 1

    def chunk(choices: list[dict], used: dict | None = None) -> str:
        extra = {"usage": used} if req.include_usage else {}
        return _event(R.envelope(rid, obj, model, created, choices, **extra))

    async def stream() -> AsyncIterator[str]:
        gone = asyncio.ensure_future(_wait_disconnect(request))
        cursors: dict[tuple[int, int], R.ChoiceCursor] = {}
        finals = {}
        opening = first
        try:
            async with aclosing(_outputs(sub, gone)) as outputs:  # closed (aborting) even if sending fails
                async for i, out in outputs:
                    if opening is not None:  # once the engine answers: clients time the first token from it
                        yield chunk(opening, R.usage(len(out.prompt_token_ids), 0) if req.continuous_usage else None)
                        opening = None
                    n = len(out.outputs)
                    for j in range(n):
                        cursor = cursors.setdefault((i, j), R.ChoiceCursor(j))
                        # Tokens whose text is not complete yet (part of a character,
                        # or a possible stop string) wait for it: chunks carry text.
                        if cursor.has_news(out) and cursor.due(out, interval):
                            body = choice(i * n + j, out, cursor.advance(out), j)
                            used = R.usage(len(out.prompt_token_ids), cursor.tokens) if req.continuous_usage else None
                            yield chunk([body], used)
                    if out.finished:
                        finals[i] = out
            if req.include_usage:
                yield _event(R.envelope(rid, obj, model, created, [], usage=usage(list(finals.values()))))
        except ClientGone:
            return
        except (EngineDeadError, CtxparError) as e:
            status = 503 if isinstance(e, EngineDeadError) else 400
            yield _event(ApiError(status, str(e)).body())
        finally:
            gone.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")
