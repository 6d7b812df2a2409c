"""Prompt types, as vLLM's ``vllm.inputs``::

    from ctxpar import LLM, TextPrompt, TokensPrompt

    llm.generate([TextPrompt(prompt="Hello"), TokensPrompt(prompt_token_ids=[1, 2, 3])])

A prompt is a string, a ``TextPrompt`` ({"prompt": text}) or a ``TokensPrompt``
({"prompt_token_ids": ids}, optionally with the "prompt" text it came from,
which is then only echoed in the output). They are TypedDicts: plain dicts
work the same. Either may carry vLLM's ``cache_salt``: prompts share
prefix-cache blocks only with prompts of the same salt, so one tenant cannot
tell from its time to first token what another's prompts began with::

    llm.generate({"prompt": "Hello", "cache_salt": "tenant-a"})
"""

from __future__ import annotations

from typing import Any

from typing_extensions import NotRequired, TypedDict

from ctxpar.errors import CtxparError


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the model's tokenizer (with its BOS, as vLLM does)."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt already tokenized; ``prompt`` is the text it came from (optional, echoed only)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt

# vLLM prompt keys that would change the output and that ctxpar cannot honour.
_REFUSED_KEYS = {
    "multi_modal_data": "ctxpar runs text-only models",
    "mm_processor_kwargs": "ctxpar runs text-only models",
    "prompt_embeds": "ctxpar takes token ids, not embeddings",
    "token_type_ids": "ctxpar's models take no token type ids",
}
_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def parse_prompt(prompt: Any, tokenizer: Any) -> tuple[str | None, Any, str | None]:
    """(text or None, token ids, cache_salt or None) of one prompt.

    Token ids are passed on as given: the engine's InputProcessor checks they are a
    sequence of integers in the vocabulary.
    """
    if isinstance(prompt, str):
        return prompt, _encode(prompt, tokenizer), None
    if not isinstance(prompt, dict):
        raise CtxparError(
            "a prompt must be a string, {'prompt': text} (TextPrompt) or {'prompt_token_ids': [...]} "
            f"(TokensPrompt), got {type(prompt).__name__}"
        )
    for key in prompt:
        if key in _REFUSED_KEYS:
            raise CtxparError(f"prompt key {key!r} is not supported: {_REFUSED_KEYS[key]}")
        if key not in _KEYS:
            raise CtxparError(
                f"unknown prompt key {key!r}; a prompt dict has 'prompt' and/or 'prompt_token_ids', and 'cache_salt'"
            )
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise CtxparError(f"'prompt' must be a string, got {type(text).__name__}")
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise CtxparError(f"'cache_salt' must be a non-empty string, got {salt!r}")
    if "prompt_token_ids" in prompt:
        return text, prompt["prompt_token_ids"], salt
    if text is None:
        raise CtxparError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids)")
    return text, _encode(text, tokenizer), salt


def _encode(text: str, tokenizer: Any) -> list[int]:
    if tokenizer is None:
        raise CtxparError("this model has no tokenizer: pass {'prompt_token_ids': [...]} instead of text")
    return list(tokenizer.encode(text))
