"""POST /v1/chat/completions: a conversation rendered by the model's chat template,
n samples, answered whole or streamed; with tools (tools.py), a choice's text
becomes tool calls (a named or required call is constrained by a grammar; "auto"
is parsed from the text by the server's --tool-call-parser).
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ctxpar.entrypoints.openai import prompts
from ctxpar.entrypoints.openai import responses as R
from ctxpar.entrypoints.openai.grammars import compile_first
from ctxpar.entrypoints.openai.limits import check_fanout
from ctxpar.entrypoints.openai.protocol import ApiError, parse
from ctxpar.entrypoints.openai.protocol_chat import ChatCompletionRequest
from ctxpar.entrypoints.openai.state import ServerDep
from ctxpar.entrypoints.openai.streaming import collect, response_id, sse, usage
from ctxpar.entrypoints.openai.tools import ToolParser, ToolPlan, merge_calls, plan_tools

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat(request: Request, state: ServerDep) -> Response:
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
    sub = state.engine_client.submit([await asyncio.to_thread(prompts.chat_request, state, req, constraint)])
    meta = (f"chatcmpl-{response_id(request, req)}", "chat.completion.chunk", state.model_name, R.now())
    choice = partial(_choice, req, tools, state.tokenizer, {})
    echoed = req.echoed()  # the first delta carries it, or the message starts with it
    if req.stream:
        first = [
            {"index": j, "delta": {"role": "assistant", "content": echoed}, "logprobs": None, "finish_reason": None}
            for j in range(req.n)
        ]
        return sse(request, sub, meta, choice, req, first=first)
    [out] = await collect(request, sub)
    choices = [choice(j, out, R.ChoiceCursor(j).advance(out), j, key="message") for j in range(len(out.outputs))]
    for c in choices:
        c["message"]["role"] = "assistant"
        if echoed:
            c["message"]["content"] = echoed + (c["message"]["content"] or "")
    extra: dict[str, Any] = {"prompt_logprobs": R.prompt_logprobs(out)} if req.prompt_logprobs is not None else {}
    return JSONResponse(R.envelope(meta[0], "chat.completion", *meta[2:], choices, usage=usage([out]), **extra))


def _choice(
    req: ChatCompletionRequest,
    tools: ToolPlan,
    tokenizer,
    parsers: dict[int, ToolParser | None],
    i: int,
    out,
    d: R.Delta,
    sample: int,
    key: str = "delta",
) -> dict:
    """Choice ``i`` of a chat completion: its ``key`` ("message" whole, or a streamed
    chunk's "delta") from ``d``, what sample ``sample`` of ``out`` adds; ``parsers``
    keeps each choice's tool parser (its text -> tool calls) from chunk to chunk."""
    parser = parsers.setdefault(i, tools.new_parser())
    msg, finish = _tool_message(parser, out, d, sample, whole=key != "delta")
    c = {
        "index": i,
        key: msg,
        "logprobs": R.chat_logprobs(tokenizer, d, req.top_logprobs or 0, bool(req.return_tokens_as_token_ids)),
        **finish,
    }
    if req.return_token_ids:
        c.update(token_ids=d.token_ids, prompt_token_ids=out.prompt_token_ids)
    return c


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
