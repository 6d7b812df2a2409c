"""A generation route's answer, from its Submission's outputs: collected whole
(``collect``) or streamed as server-sent events (``sse``). Either way a client
that disconnects aborts its requests: its ``http.disconnect`` ends the
submission's output iterator with ClientGone, and closing the iterator aborts
what is unfinished."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import cast

from fastapi import Request
from fastapi.responses import StreamingResponse

from ctxpar.engine.async_llm import EngineDeadError
from ctxpar.engine.submission import ClientGone, Submission
from ctxpar.entrypoints.openai import responses as R
from ctxpar.entrypoints.openai.protocol import ApiError
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


def sse(
    request: Request, sub: Submission, meta: tuple, choice: ChoiceFn, include_usage: bool, first: list[dict] | None
) -> StreamingResponse:
    """A server-sent-event response: ``first`` (if any), one chunk per new output of
    each choice (``choice`` makes its body), then usage if asked, then [DONE]."""
    rid, obj, model, created = meta

    def chunk(choices: list[dict]) -> str:
        extra = {"usage": None} if include_usage else {}
        return _event(R.envelope(rid, obj, model, created, choices, **extra))

    async def stream() -> AsyncIterator[str]:
        gone = asyncio.ensure_future(_wait_disconnect(request))
        cursors: dict[tuple[int, int], R.ChoiceCursor] = {}
        finals = {}
        try:
            if first is not None:
                yield chunk(first)
            async with aclosing(_outputs(sub, gone)) as outputs:  # closed (aborting) even if sending fails
                async for i, out in outputs:
                    n = len(out.outputs)
                    for j in range(n):
                        cursor = cursors.setdefault((i, j), R.ChoiceCursor(j))
                        # Tokens whose text is not complete yet (part of a character,
                        # or a possible stop string) wait for it: chunks carry text.
                        if cursor.has_news(out):
                            yield chunk([choice(i * n + j, out, cursor.advance(out), j)])
                    if out.finished:
                        finals[i] = out
            if include_usage:
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
