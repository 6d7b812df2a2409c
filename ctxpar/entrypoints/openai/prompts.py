"""A request body's prompts as the engine's requests: text tokenized (or token ids
taken as given), a conversation rendered by the chat template, truncated as the
body asks, each checked with its SamplingParams.

These run on a worker thread (asyncio.to_thread): tokenizing or templating a
16 MiB body takes seconds, which on the event loop would stall every stream.
"""

from __future__ import annotations

import dataclasses

from ctxpar.engine.input_processor import EngineRequest
from ctxpar.entrypoints.openai.failures import template_error
from ctxpar.entrypoints.openai.limits import check_logprobs
from ctxpar.entrypoints.openai.protocol import ApiError, SamplingRequest
from ctxpar.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatMessage
from ctxpar.entrypoints.openai.protocol_completions import CompletionRequest
from ctxpar.entrypoints.openai.state import ServerState
from ctxpar.errors import CtxparError
from ctxpar.structured_params import StructuredOutputsParams


def encode(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    """The text's tokens, as LLM.generate tokenizes it (so outputs match it token for token)."""
    if state.tokenizer is None:
        raise CtxparError("this model has no tokenizer: send the prompt as token ids")
    return list(state.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def render_chat(
    state: ServerState,
    messages: list[ChatMessage],
    chat_template_kwargs: dict | None = None,
    tools: list | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> dict:
    """{"prompt", "prompt_token_ids"} of the conversation, as LLM.chat renders it."""
    try:
        [rendered] = state.llm.apply_chat_template(
            [m.as_template_input() for m in messages],
            chat_template_kwargs,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except (CtxparError, ApiError):
        raise
    except Exception as e:  # the template's own refusal (jinja), e.g. roles out of order
        raise template_error(e) from None  # no exception text but a template's own refusal
    return rendered


def _engine_request(
    state: ServerState,
    req: SamplingRequest,
    ids: list[int],
    text: str | None,
    logprobs: int | None,
    constraint: StructuredOutputsParams | None,
) -> EngineRequest:
    """One prompt's engine request, queued by its priority; truncated, it keeps no text (echo then
    decodes what is left)."""
    max_model_len = state.engine.max_model_len
    kept = req.truncate(ids, max_model_len)
    params = req.sampling_params(len(kept), max_model_len, logprobs, constraint)
    checked = state.engine.processor.process_tokens(kept, params, text if len(kept) == len(ids) else None)
    return dataclasses.replace(checked, priority=req.priority)


def completion_requests(
    state: ServerState,
    req: CompletionRequest,
    prompts: list[str | list[int]],
    constraint: StructuredOutputsParams | None,
) -> list[EngineRequest]:
    """The engine's request of each prompt of a completion request, checked."""
    out = []
    for p in prompts:
        text, ids = (p, encode(state, p, req.add_special_tokens)) if isinstance(p, str) else (None, p)
        out.append(_engine_request(state, req, ids, text, req.logprobs, constraint))
    check_logprobs(state.limits, out, state.engine.processor.vocab_size)
    return out


def chat_request(
    state: ServerState, req: ChatCompletionRequest, constraint: StructuredOutputsParams | None
) -> EngineRequest:
    """The engine's request of a chat request: its rendered conversation, checked."""
    rendered = render_chat(
        state,
        req.messages,
        req.template_kwargs(),
        req.tools,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
    )
    ids = rendered["prompt_token_ids"]
    if req.add_special_tokens:  # the template's text, with the tokenizer's own specials on top (vLLM's option)
        ids = encode(state, rendered["prompt"], add_special_tokens=True)
    request = _engine_request(state, req, ids, rendered["prompt"], req.num_logprobs, constraint)
    check_logprobs(state.limits, [request], state.engine.processor.vocab_size)
    return request
