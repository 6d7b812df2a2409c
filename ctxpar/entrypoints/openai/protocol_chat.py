"""The body of POST /v1/chat/completions, and its messages as the chat template reads them."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from ctxpar.entrypoints.chat import template_content, text_parts
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
    # vLLM extensions: how the conversation becomes the prompt.
    add_generation_prompt: bool = True  # the template's opening of the assistant's turn
    continue_final_message: bool = False  # leave the last message open: the answer continues it
    add_special_tokens: bool = False  # the tokenizer's BOS on top of the template's own
    documents: list[dict[str, str]] | None = None  # for a template that takes them (RAG)
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # given to the template
    include_reasoning: bool = True  # no reasoning parser: no reasoning is split out to include or drop
    echo: bool = False  # the last message's content before the answer, when it is the assistant's
    chat_template: Any = None  # vLLM's; refused (UNSUPPORTED)
    mm_processor_kwargs: Any = None  # vLLM's; refused (UNSUPPORTED)

    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {
        **SamplingRequest.UNSUPPORTED,
        "chat_template": ((None,), "a request may not bring its own template; start the server with another model"),
        "mm_processor_kwargs": ((None,), "ctxpar runs text models: there is no multimodal processor"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise ApiError(400, "messages is empty: give at least one message", param="messages")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ApiError(400, "max_tokens and max_completion_tokens differ: give one", param="max_tokens")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:  # 0 without logprobs asks for nothing, as in vLLM
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        reserved = {"add_generation_prompt", "tokenize", "conversation"} & set(self.chat_template_kwargs or {})
        if reserved:
            raise ApiError(
                400, f"chat_template_kwargs may not set {', '.join(sorted(reserved))}", param="chat_template_kwargs"
            )

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with the template variables vLLM gives from the body's own fields."""
        given = {k: v for k, v in (("documents", self.documents), ("reasoning_effort", self.reasoning_effort)) if v}
        return {**given, **(self.chat_template_kwargs or {})} or None

    def echoed(self) -> str:
        """What echo puts before the answer: the last message's text, when the assistant wrote it."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return ""
        return "\n".join(text_parts(last.content))

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
