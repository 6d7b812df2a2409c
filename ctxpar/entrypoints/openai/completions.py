"""POST /v1/completions: prompts (text or token ids) x n samples, answered whole or streamed.

The request is tokenized and validated completely (on a worker thread, off the
event loop) before it reaches the engine: a bad one gets a 400 with the
engine's own message and disturbs no other.
"""

from __future__ import annotations

import asyncio
import dataclasses
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ctxpar.entrypoints.openai import prompts
from ctxpar.entrypoints.openai import responses as R
from ctxpar.entrypoints.openai.grammars import compile_first
from ctxpar.entrypoints.openai.limits import check_fanout
from ctxpar.entrypoints.openai.protocol import parse
from ctxpar.entrypoints.openai.protocol_completions import CompletionRequest
from ctxpar.entrypoints.openai.state import ServerDep
from ctxpar.entrypoints.openai.streaming import collect, response_id, sse, usage

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, state: ServerDep) -> Response:
    req: CompletionRequest = parse(CompletionRequest, await request.body())
    state.check_model(req.model)
    given = req.prompts()
    check_fanout(state.limits, len(given), req.n, req.best_of)
    constraint = req.structured_outputs_params()
    await compile_first(state.engine.structured, constraint)
    sub = state.engine_client.submit(
        await asyncio.to_thread(prompts.completion_requests, state, req, given, constraint)
    )
    meta = (f"cmpl-{response_id(request, req)}", "text_completion", state.model_name, R.now())
    choice = partial(_choice, req, state.tokenizer)
    if req.stream:
        return sse(request, sub, meta, choice, req, first=None)
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
    tokens of sample ``sample`` of ``out`` not sent yet. With echo the prompt goes
    before the first (with its logprobs: completions' way of scoring a prompt), and
    later chunks' offsets count it; echo with max_tokens 0 answers the prompt alone."""
    if req.echo_only:
        d = R.Delta("", [], [] if d.logprobs is not None else None, d.text_offset)
    generated = d.token_ids
    if req.echo and d.text_offset == 0:
        d = R.echoed(out, tokenizer, d)
    elif req.echo:
        prompt = out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)
        d = dataclasses.replace(d, text_offset=d.text_offset + len(prompt))
    finish = R.finish_fields(out, sample)
    if req.echo_only and finish["finish_reason"] is not None:
        # The answer ends at max_tokens=0 whatever its hidden token was (an EOS would say "stop").
        finish = {"finish_reason": "length", "stop_reason": None}
    c = {
        "index": i,
        "text": d.text,
        "logprobs": R.completion_logprobs(tokenizer, d, bool(req.return_tokens_as_token_ids)),
        **finish,
    }
    if req.prompt_logprobs is not None:
        c["prompt_logprobs"] = R.prompt_logprobs(out)
    if req.return_token_ids:
        c.update(token_ids=generated, prompt_token_ids=out.prompt_token_ids)
    return c
