"""POST /tokenize and /detokenize (vLLM's): a prompt or a conversation to token
ids, token ids to text, with the server's tokenizer and chat template.

Admitted like generation (guard.py's GATED); the tokenizer runs on a worker thread:
a 16 MiB prompt takes seconds to tokenize, which would stall every stream on the loop.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from ctxpar.entrypoints.openai.protocol import ApiError, parse
from ctxpar.entrypoints.openai.protocol_tokens import DetokenizeRequest, TokenizeRequest
from ctxpar.entrypoints.openai.state import ServerDep
from ctxpar.errors import CtxparError

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request, state: ServerDep) -> dict:
    req: TokenizeRequest = parse(TokenizeRequest, await request.body())
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        tokens = await asyncio.to_thread(state.encode, req.prompt, req.add_special_tokens)
    elif req.messages is not None:  # always, the one given
        tokens = (await asyncio.to_thread(state.render_chat, req.messages))["prompt_token_ids"]
    return {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(request: Request, state: ServerDep) -> dict:
    req: DetokenizeRequest = parse(DetokenizeRequest, await request.body())
    state.check_model(req.model)
    if state.tokenizer is None:
        raise CtxparError("this model has no tokenizer")
    vocab = state.engine.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": await asyncio.to_thread(state.tokenizer.decode, req.tokens)}
