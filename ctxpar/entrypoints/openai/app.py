"""The HTTP side: FastAPI routes of the OpenAI API (plus vLLM's /tokenize,
/detokenize, /health and /metrics).

Handlers tokenize and validate a request completely (on a worker thread, off
the event loop) before it reaches the engine (a bad one gets a 400 with the
engine's own message and disturbs no other), submit it to the AsyncLLM
(ctxpar/engine/async_llm.py), and turn its outputs into OpenAI bodies or
server-sent events. A client that disconnects aborts its requests. In
front of the routes, ClientGuard (guard.py) checks the API key (access.py),
reads bodies within the limits and admits generation and tokenizer requests
within the concurrency limits (limits.py).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ctxpar.engine.async_llm import AsyncLLM, ClientGone, EngineDeadError, Prepared, Submission
from ctxpar.entrypoints.openai import health as H
from ctxpar.entrypoints.openai import responses as R
from ctxpar.entrypoints.openai.access import Access
from ctxpar.entrypoints.openai.grammars import compile_first
from ctxpar.entrypoints.openai.guard import ClientGuard
from ctxpar.entrypoints.openai.limits import Admission, BodyBudget, ServerLimits, check_fanout
from ctxpar.entrypoints.openai.metrics import ServerMetrics
from ctxpar.entrypoints.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)
from ctxpar.entrypoints.openai.tools import ToolParser, merge_calls, plan_tools
from ctxpar.errors import CtxparError
from ctxpar.structured_params import StructuredOutputsParams


class ServerState:
    """What the routes share: the LLM (its engine and chat template), the async engine over
    it (whose loop the caller runs: ``engine_client.run_engine_loop()``), the name, who may
    call what (the API key), the parser of tool_choice "auto" (None: "auto" is refused) and
    the client limits (the grammar cache's among them)."""

    def __init__(
        self,
        llm,
        model_name: str,
        access: Access,
        tool_parser: str | None = None,
        limits: ServerLimits = ServerLimits(),
    ) -> None:
        self.llm = llm
        self.limits = limits
        self.admission = Admission(limits)
        self.budget = BodyBudget(limits)
        self.access = access
        self.tool_parser = tool_parser
        self.engine = llm.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = model_name
        self.engine.structured.configure(limits.grammar_cache_bytes, limits.grammar_compile_timeout)
        self.metrics = ServerMetrics(model_name)
        self.engine_client = AsyncLLM(llm.llm_engine, start_engine_loop=False, stat_loggers=[self.metrics])
        self.metrics.rank_recovery.source = lambda: self.engine_client.rank_recovery

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(
                404, f"the model `{name}` does not exist; this server serves `{self.model_name}`", param="model"
            )

    def render_chat(self, messages: list, chat_template_kwargs: dict | None = None, tools: list | None = None) -> dict:
        """{"prompt", "prompt_token_ids"} of the conversation, as LLM.chat renders it."""
        try:
            [rendered] = self.llm.apply_chat_template(
                [m.as_template_input() for m in messages], chat_template_kwargs, tools=tools
            )
        except (CtxparError, ApiError):
            raise
        except Exception as e:  # the template's own refusal (jinja), e.g. roles out of order
            raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
        return rendered

    # The two below run on a worker thread: tokenizing or templating a 16 MiB body takes
    # seconds, which on the event loop would stall every stream.
    def prepare_prompts(
        self, req: CompletionRequest, prompts: list[str | list[int]], constraint: StructuredOutputsParams | None
    ) -> list[Prepared]:
        """The engine's (text, token ids, params) of each prompt of a completion request, validated."""
        out = []
        for p in prompts:
            text, ids = (p, self.encode(p)) if isinstance(p, str) else (None, p)
            params = req.sampling_params(len(ids), self.engine.max_model_len, req.logprobs, constraint)
            out.append((text, self.engine.validate(ids, params), params))
        return out

    def prepare_chat(self, req: ChatCompletionRequest, constraint: StructuredOutputsParams | None) -> Prepared:
        """The engine's (text, token ids, params) of a chat request: its rendered conversation, validated."""
        rendered = self.render_chat(req.messages, req.chat_template_kwargs, req.tools)
        ids = rendered["prompt_token_ids"]
        params = req.sampling_params(len(ids), self.engine.max_model_len, req.num_logprobs, constraint)
        return rendered["prompt"], self.engine.validate(ids, params), params

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The same tokenization as LLM.generate's, so outputs match it token for token.
        if self.tokenizer is None:
            raise CtxparError("this model has no tokenizer: send the prompt as token ids")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def build_app(state: ServerState) -> FastAPI:
    """The routes over ``state``; its EngineLoop must run (see command.py) for requests to finish."""

    # The API's description is off unless asked for: it maps the server for anyone who can reach it.
    docs = state.access.enable_docs
    app = FastAPI(
        title="ctxpar",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.ctxpar = state
    app.add_middleware(
        ClientGuard, limits=state.limits, admission=state.admission, access=state.access, budget=state.budget
    )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(CtxparError)
    async def _user_error(request: Request, e: CtxparError) -> JSONResponse:
        return JSONResponse(ApiError(400, str(e)).body(), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return JSONResponse(ApiError(503, str(e)).body(), status_code=503)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.get("/health")
    async def health() -> Response:
        status, body = H.report(state.engine_client, state.admission)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": R.now(),
            "owned_by": "ctxpar",
            "root": state.engine.loaded.name,
            "max_model_len": state.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await request.body())
        state.check_model(req.model)
        given = req.prompts()
        check_fanout(state.limits, len(given), req.n, req.best_of)
        constraint = req.structured_outputs_params()
        await compile_first(state.engine.structured, constraint)
        sub = state.engine_client.submit(await asyncio.to_thread(state.prepare_prompts, req, given, constraint))
        meta = (f"cmpl-{uuid.uuid4().hex}", "text_completion", state.model_name, R.now())

        def choice(i: int, out, d: R.Delta, sample: int) -> dict:
            text = d.text
            if req.echo and d.text_offset == 0:  # the choice's first text: the prompt goes before it
                text = (out.prompt if out.prompt is not None else state.tokenizer.decode(out.prompt_token_ids)) + text
            c = {
                "index": i,
                "text": text,
                "logprobs": R.completion_logprobs(state.tokenizer, d),
                **R.finish_fields(out, sample),
            }
            if req.prompt_logprobs is not None:
                c["prompt_logprobs"] = R.prompt_logprobs(out)
            if req.return_token_ids:
                c.update(token_ids=d.token_ids, prompt_token_ids=out.prompt_token_ids)
            return c

        if req.stream:
            return _sse(request, sub, meta, choice, req.include_usage, first=None)
        outs = await _collect(request, sub)
        # Prompt i's sample j is choice i * n + j, as vLLM numbers them.
        choices = [
            choice(i * req.n + j, o, R.ChoiceCursor(j).advance(o), j)
            for i, o in enumerate(outs)
            for j in range(len(o.outputs))
        ]
        return JSONResponse(R.envelope(*meta, choices, usage=_usage(outs)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await request.body())
        state.check_model(req.model)
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, state.tool_parser)
        constraint = req.structured_outputs_params()
        if tools.constraint is not None:
            if constraint is not None:
                raise ApiError(400, "tool_choice and response_format both constrain the output: give one")
            constraint = tools.constraint
        check_fanout(state.limits, 1, req.n)
        await compile_first(state.engine.structured, constraint)
        sub = state.engine_client.submit([await asyncio.to_thread(state.prepare_chat, req, constraint)])
        meta = (f"chatcmpl-{uuid.uuid4().hex}", "chat.completion.chunk", state.model_name, R.now())
        top = req.top_logprobs or 0
        parsers: dict[int, ToolParser | None] = {}  # per choice: its text -> tool calls

        def choice(i: int, out, d: R.Delta, sample: int, key: str = "delta") -> dict:
            msg, finish = _tool_message(parsers.setdefault(i, tools.new_parser()), out, d, sample, whole=key != "delta")
            c = {
                "index": i,
                key: msg,
                "logprobs": R.chat_logprobs(state.tokenizer, d, top),
                **finish,
            }
            if req.return_token_ids:
                c.update(token_ids=d.token_ids, prompt_token_ids=out.prompt_token_ids)
            return c

        if req.stream:
            first = [
                {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for j in range(req.n)
            ]
            return _sse(request, sub, meta, choice, req.include_usage, first=first)
        [out] = await _collect(request, sub)
        choices = [choice(j, out, R.ChoiceCursor(j).advance(out), j, key="message") for j in range(len(out.outputs))]
        for c in choices:
            c["message"]["role"] = "assistant"
        extra = {"prompt_logprobs": R.prompt_logprobs(out)} if req.prompt_logprobs is not None else {}
        return JSONResponse(R.envelope(meta[0], "chat.completion", *meta[2:], choices, usage=_usage([out]), **extra))

    # Admitted like generation (guard.py's GATED); the tokenizer runs on a worker thread:
    # a 16 MiB prompt takes seconds to tokenize, which would stall every stream on the loop.
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req: TokenizeRequest = parse(TokenizeRequest, await request.body())
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            tokens = await asyncio.to_thread(state.encode, req.prompt, req.add_special_tokens)
        else:
            tokens = (await asyncio.to_thread(state.render_chat, req.messages))["prompt_token_ids"]
        return {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req: DetokenizeRequest = parse(DetokenizeRequest, await request.body())
        state.check_model(req.model)
        if state.tokenizer is None:
            raise CtxparError("this model has no tokenizer")
        vocab = state.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, req.tokens)}

    return app


def _tool_message(parser: ToolParser | None, out, d: R.Delta, sample: int, whole: bool) -> tuple[dict, dict]:
    """A chat choice's message (whole) or delta, and its finish fields: the text
    as content, or, through the parser, as tool calls ("tool_calls" then ends it)."""
    finish = R.finish_fields(out, sample)
    if parser is None:
        return {"content": d.text}, finish
    content, calls = parser.feed(d.text)
    if finish["finish_reason"] is not None:
        rest, more = parser.finish()
        content, calls = content + rest, calls + more
    if parser.called and finish["finish_reason"] == "stop":
        finish["finish_reason"] = "tool_calls"
    if not whole:
        return ({"content": content} if content or not calls else {}) | ({"tool_calls": calls} if calls else {}), finish
    if not parser.called:
        return {"content": d.text}, finish  # no call after all: the text as it came
    return {"content": content or None, "tool_calls": merge_calls(calls)}, finish


def _usage(outs) -> dict:
    return R.usage(sum(len(o.prompt_token_ids) for o in outs), sum(len(c.token_ids) for o in outs for c in o.outputs))


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, sub: Submission) -> list:
    """The final output of each of the submission's requests, in order."""
    gone = asyncio.ensure_future(_wait_disconnect(request))
    final = {}
    try:
        # ClientGone if the client leaves; closing the iterator aborts what is unfinished.
        async with aclosing(sub.outputs(gone)) as outputs:
            async for i, out in outputs:
                if out.finished:
                    final[i] = out
    finally:
        gone.cancel()
    return [final[i] for i in range(len(final))]


def _sse(request: Request, sub: Submission, meta: tuple, choice, include_usage: bool, first: list[dict] | None):
    """A server-sent-event response: one chunk per new output, then usage if asked, then [DONE]."""
    rid, obj, model, created = meta

    def event(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def chunk(choices: list[dict]) -> str:
        extra = {"usage": None} if include_usage else {}
        return event(R.envelope(rid, obj, model, created, choices, **extra))

    async def stream() -> AsyncIterator[str]:
        gone = asyncio.ensure_future(_wait_disconnect(request))
        cursors: dict[tuple[int, int], R.ChoiceCursor] = {}
        finals = {}
        try:
            if first is not None:
                yield chunk(first)
            async with aclosing(sub.outputs(gone)) as outputs:  # closed (aborting) even if sending fails
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
                yield event(R.envelope(rid, obj, model, created, [], usage=_usage(list(finals.values()))))
        except ClientGone:
            return
        except (EngineDeadError, CtxparError) as e:
            status = 503 if isinstance(e, EngineDeadError) else 400
            yield event(ApiError(status, str(e)).body())
        finally:
            gone.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")
