"""The body of POST /v1/chat/completions, and its messages as the chat template reads them."""

from __future__ import annotations

import json
from typing import Any

from ctxpar.entrypoints.chat import template_content
from ctxpar.entrypoints.openai.protocol import ApiError, SamplingRequest, StrictBody
from ctxpar.errors import CtxparError


class ChatMessage(StrictBody):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def as_template_input(self) -> dict:
        """{"role", "content", ...} with the content as one string, as LLM.chat renders it;
        tool call arguments as dicts, as chat templates read them (vLLM does the same)."""
        try:
            content = template_content(self.content, "string")
        except CtxparError as e:
            raise ApiError(400, str(e), param="messages") from None
        msg: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            msg["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return msg


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, "a message's tool_calls must be {'function': {'name', 'arguments'}}", param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # the template gets the text as it was sent
    return {**call, "function": {**fn, "arguments": args}}


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension, e.g. {"enable_thinking": false}
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise ApiError(400, "messages is empty: give at least one message", param="messages")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ApiError(400, "max_tokens and max_completion_tokens differ: give one", param="max_tokens")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        reserved = {"add_generation_prompt", "tokenize", "conversation"} & set(self.chat_template_kwargs or {})
        if reserved:
            raise ApiError(
                400, f"chat_template_kwargs may not set {', '.join(sorted(reserved))}", param="chat_template_kwargs"
            )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
