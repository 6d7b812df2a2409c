"""POST /v1/completions: prompts (text or token ids) x n samples, answered whole or streamed.

The request is tokenized and validated completely (on a worker thread, off the
event loop) before it reaches the engine: a bad one gets a 400 with the
engine's own message and disturbs no other.
"""

from __future__ import annotations

import asyncio
import uuid
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ctxpar.entrypoints.openai import responses as R
from ctxpar.entrypoints.openai.grammars import compile_first
from ctxpar.entrypoints.openai.limits import check_fanout
from ctxpar.entrypoints.openai.protocol import parse
from ctxpar.entrypoints.openai.protocol_completions import CompletionRequest
from ctxpar.entrypoints.openai.state import ServerDep
from ctxpar.entrypoints.openai.streaming import collect, sse, usage

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, state: ServerDep) -> Response:
    req: CompletionRequest = parse(CompletionRequest, await request.body())
    state.check_model(req.model)
    given = req.prompts()
    check_fanout(state.limits, len(given), req.n, req.best_of)
    constraint = req.structured_outputs_params()
    await compile_first(state.engine.structured, constraint)
    sub = state.engine_client.submit(await asyncio.to_thread(state.prepare_prompts, req, given, constraint))
    meta = (f"cmpl-{uuid.uuid4().hex}", "text_completion", state.model_name, R.now())
    choice = partial(_choice, req, state.tokenizer)
    if req.stream:
        return sse(request, sub, meta, choice, req.include_usage, first=None)
    outs = await collect(request, sub)
    # Prompt i's sample j is choice i * n + j, as vLLM numbers them.
    choices = [
        choice(i * req.n + j, o, R.ChoiceCursor(j).advance(o), j)
        for i, o in enumerate(outs)
        for j in range(len(o.outputs))
    ]
    return JSONResponse(R.envelope(*meta, choices, usage=usage(outs)))


def _choice(req: CompletionRequest, tokenizer, i: int, out, d: R.Delta, sample: int) -> dict:
    """Choice ``i`` of a completion (whole or a streamed chunk's): ``d``, the text and
    tokens of sample ``sample`` of ``out`` not sent yet (echo: the prompt before the first)."""
    text = d.text
    if req.echo and d.text_offset == 0:  # the choice's first text: the prompt goes before it
        text = (out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)) + text
    c = {
        "index": i,
        "text": text,
        "logprobs": R.completion_logprobs(tokenizer, d),
        **R.finish_fields(out, sample),
    }
    if req.prompt_logprobs is not None:
        c["prompt_logprobs"] = R.prompt_logprobs(out)
    if req.return_token_ids:
        c.update(token_ids=d.token_ids, prompt_token_ids=out.prompt_token_ids)
    return c
