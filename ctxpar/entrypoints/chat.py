"""Chat conversations -> prompts, as vLLM's ``LLM.chat`` renders them.

Shared by ``LLM.chat`` / ``LLM.apply_chat_template`` and the server's
/v1/chat/completions, so both give the same tokens for the same messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ctxpar.errors import CtxparError
from ctxpar.inputs import TokensPrompt

# Arguments of tokenizer.apply_chat_template that the renderer sets itself.
RESERVED_TEMPLATE_KWARGS = ("tokenize", "conversation", "messages")


def is_conversation_list(messages: Any) -> bool:
    """True for a list of conversations, False for one conversation (a list of message dicts)."""
    return isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))


CONTENT_FORMATS = ("auto", "string", "openai")


def text_parts(content: Any) -> list[str]:
    """The texts of a message's content: a string, None, or a list of text parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, (list, tuple)):
        raise CtxparError(f"message content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise CtxparError(
                f"content part {kind!r} is not supported: ctxpar runs text models; "
                "give parts as {'type': 'text', 'text': ...}"
            )
    return texts


def template_content(content: Any, content_format: str) -> str | list[dict[str, str]]:
    """A message's content as the template takes it: one string ("string"; text
    parts joined with newlines, as vLLM does) or a list of text parts ("openai").
    "auto" is "string": every text model's template takes strings."""
    texts = text_parts(content)
    if content_format == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def load_chat_template(chat_template: str | None) -> str | None:
    """A template string, or the contents of the file it names (vLLM accepts both)."""
    if chat_template is None:
        return None
    if not isinstance(chat_template, str) or not chat_template:
        raise CtxparError(
            f"chat_template must be a Jinja template or the path of a file holding one, got {chat_template!r}"
        )
    if "{" not in chat_template:  # no Jinja syntax: a file name
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise CtxparError(f"chat_template {chat_template!r} is neither a Jinja template nor an existing file")
        return path.read_text()
    return chat_template


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    chat_template_content_format: str = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> TokensPrompt:
    """One conversation -> {"prompt", "prompt_token_ids"}.

    chat_template: overrides the tokenizer's (a template string or a file path).
    chat_template_content_format: message content as a string ("string", or
        "auto") or a list of {"type": "text", "text": ...} parts ("openai").
    continue_final_message: leave the last message open so the model continues
        it (vLLM's option; excludes add_generation_prompt).
    chat_template_kwargs: extra variables for the template; they override the
        options above, as in vLLM.
    """
    if chat_template_content_format not in CONTENT_FORMATS:
        raise CtxparError(
            f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
            f"got {chat_template_content_format!r}"
        )
    template = load_chat_template(chat_template)
    if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
        raise CtxparError(
            "this model's tokenizer has no chat template; pass chat_template=... or use generate() with plain text"
        )
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise CtxparError("a conversation must be a non-empty list of {'role': ..., 'content': ...} messages")
    kwargs: dict[str, Any] = dict(
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, tools=tools
    )
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(set(RESERVED_TEMPLATE_KWARGS) & set(extra))
    if reserved:
        raise CtxparError(f"chat_template_kwargs may not set {', '.join(reserved)}: the renderer sets them")
    kwargs.update(extra)
    if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
        raise CtxparError(
            "continue_final_message=True continues the last message, add_generation_prompt=True starts a new one: "
            "set add_generation_prompt=False"
        )
    messages = []
    for m in conversation:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise CtxparError(f"a message must be a dict with a 'role' string and 'content', got {m!r}")
        messages.append({**m, "content": template_content(m.get("content"), chat_template_content_format)})
    # Imported here: jinja2 is tens of ms of a start that may never render a chat.
    from ctxpar.entrypoints.chat_template import apply_chat_template

    text = apply_chat_template(tokenizer, messages, template, **kwargs)  # transformers' text, without transformers
    # The template writes BOS and friends itself: the tokenizer must add no more.
    return TokensPrompt(prompt=text, prompt_token_ids=list(tokenizer.encode(text, add_special_tokens=False)))
