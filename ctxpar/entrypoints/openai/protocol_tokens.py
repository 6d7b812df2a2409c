"""The bodies of POST /tokenize and /detokenize (vLLM's)."""

from __future__ import annotations

from ctxpar.entrypoints.openai.protocol import StrictBody
from ctxpar.entrypoints.openai.protocol_chat import ChatMessage


class TokenizeRequest(StrictBody):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(StrictBody):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[int]
