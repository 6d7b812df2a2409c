"""The HTTP side: a FastAPI app of the OpenAI API (plus vLLM's /tokenize,
/detokenize, /health and /metrics), assembled by ``build_app``.

The routes are module-level handlers on one router per job, reaching the
ServerState (state.py) that the app keeps through the ``ServerDep`` dependency:

- info.py: GET /health, /metrics, /v1/models;
- completions.py: POST /v1/completions;
- chat_completions.py: POST /v1/chat/completions (tool calls: tools.py);
- tokens.py: POST /tokenize, /detokenize.

Handlers tokenize and validate a request completely (on a worker thread, off
the event loop) before it reaches the engine (a bad one gets a 400 with the
engine's own message and disturbs no other), submit it to the AsyncLLM
(ctxpar/engine/async_llm.py), and turn its outputs into OpenAI bodies or
server-sent events (streaming.py). A client that disconnects aborts its
requests. Before a request exists, uvicorn's protocol bounds its connection
(connections.py: a deadline for its head, a cap on connections). In front of
the routes, ClientGuard (guard.py) checks the API key or, without one, the Host
(access.py), takes JSON bodies only, reads them within the limits and admits
generation and tokenizer requests within the concurrency limits (limits.py). The exception
handlers below turn the errors a route raises into OpenAI error bodies.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ctxpar.engine.async_llm import EngineDeadError
from ctxpar.engine.submission import ClientGone
from ctxpar.entrypoints.openai import chat_completions, completions, info, tokens
from ctxpar.entrypoints.openai.guard import ClientGuard
from ctxpar.entrypoints.openai.protocol import ApiError
from ctxpar.entrypoints.openai.state import ServerState
from ctxpar.errors import CtxparError

__all__ = ["ServerState", "build_app"]


def build_app(state: ServerState) -> FastAPI:
    """The app over ``state``: the guard, the error handlers, the routes. Requests finish only while
    the engine loop runs (``state.engine_client.run_engine_loop()``, as ctxpar/entrypoints/cli/serve.py does)."""
    # The API's description is off unless asked for: it maps the server for anyone who can reach it.
    docs = state.access.enable_docs
    app = FastAPI(
        title="ctxpar",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        # What a route's error is answered with (the handler of the exception's closest class).
        exception_handlers={ApiError: _api_error, CtxparError: _user_error, EngineDeadError: _dead, ClientGone: _gone},
    )
    app.state.ctxpar = state
    app.add_middleware(
        ClientGuard, limits=state.limits, admission=state.admission, access=state.access, budget=state.budget
    )
    for routes in (info, completions, chat_completions, tokens):  # in this order: /openapi.json lists them so
        app.include_router(routes.router)
    return app


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _user_error(request: Request, e: CtxparError) -> JSONResponse:
    return JSONResponse(ApiError(400, str(e)).body(), status_code=400)


async def _dead(request: Request, e: EngineDeadError) -> JSONResponse:
    return JSONResponse(ApiError(503, str(e)).body(), status_code=503)


async def _gone(request: Request, e: ClientGone) -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it
