"""POST /tokenize and /detokenize (vLLM's): a prompt or a conversation to token
ids, token ids to text, with the server's tokenizer and chat template; and GET
/tokenizer_info (vLLM's), the tokenizer's special tokens and chat template, from
which lm-evaluation-harness's remote tokenizer works (it finds this route and
then tokenizes through /tokenize, so it needs no copy of the tokenizer).

Admitted like generation (guard.py's GATED); the tokenizer runs on a worker thread:
a 16 MiB prompt takes seconds to tokenize, which would stall every stream on the loop.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from ctxpar.entrypoints.openai import prompts
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
        tokens = await asyncio.to_thread(prompts.encode, state, req.prompt, req.add_special_tokens)
    elif req.messages is not None:  # always, the one given
        tokens = (await asyncio.to_thread(prompts.render_chat, state, req.messages))["prompt_token_ids"]
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


# What /tokenizer_info tells of the tokenizer: the fields vLLM's TokenizerInfo and lm-eval's
# RemoteTokenizer read (the special tokens as text; the chat template).
INFO_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template", "model_max_length")


@router.get("/tokenizer_info")
async def tokenizer_info(state: ServerDep) -> dict:
    tok = state.tokenizer
    if tok is None:
        raise CtxparError("this model has no tokenizer")
    info = {name: _text(getattr(tok, name, None)) for name in INFO_FIELDS}
    info["model_max_length"] = state.engine.max_model_len
    return {"tokenizer_class": type(tok).__name__, **info}


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None
