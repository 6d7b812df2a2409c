"""Chat templates rendered with jinja2 alone, as transformers renders them.

A GGUF's tokenizer is read without transformers (models/gguf_tokenizer.py); its
``apply_chat_template`` would import transformers (seconds of a start) on the first
chat of ``ctxpar generate --chat``, ``LLM.chat`` or the server. ``apply_chat_template``
here gives the same text, character for character, as transformers 5's
(transformers/tokenization_utils_base.py, transformers/utils/chat_template_utils.py):

- the same sandbox: jinja2's ImmutableSandboxedEnvironment with trim_blocks and
  lstrip_blocks, the loopcontrols extension and a ``{% generation %}`` block that
  renders its body; the globals ``raise_exception`` (a TemplateError of that class
  exactly, whose text the template's author wrote), ``strftime_now``, a ``dict`` that
  only builds dicts and a ``namespace`` that refuses underscore names; ``tojson`` as
  ``json.dumps`` (no HTML escaping; ensure_ascii, indent, separators, sort_keys);
- the same variables: the tokenizer's special tokens (bos_token, eos_token, ...) under
  the caller's keyword arguments, messages (None values dropped, a message's reasoning
  copied under the names templates read), tools, documents, add_generation_prompt,
  everything rebuilt from plain JSON values so no object's methods reach the template;
- the same ``continue_final_message``: the last message rendered with a tag after it,
  the text cut at the tag.

What this does not reproduce goes to transformers, decided in ``_needs_transformers``
alone: a tokenizer with several named templates, tools given as Python functions
(their JSON schema is transformers' ``get_json_schema``) and the arguments that
only matter when transformers tokenizes (return_assistant_tokens_mask,
sanitize_control_tokens, padding, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ctxpar.errors import CtxparError

# apply_chat_template's own arguments that act only when it tokenizes or on inputs
# this module does not convert: where a caller gives one, transformers renders.
TRANSFORMERS_ONLY = (
    "return_assistant_tokens_mask",
    "sanitize_control_tokens",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "tokenizer_kwargs",
)
# Names a message's reasoning is given under; the first is the one most templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    *,
    tools: list[Any] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **kwargs: Any,
) -> str:
    """The text ``tokenizer.apply_chat_template(messages, chat_template=..., tokenize=False, ...)``
    gives, rendered here (transformers is not imported) unless ``_needs_transformers``."""
    if _needs_transformers(tokenizer, tools, kwargs):
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
        text = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False, tools=tools, documents=documents, **options, **kwargs
        )
        return str(text)
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if template is None:
        raise CtxparError("this model's tokenizer has no chat template; pass chat_template=...")
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible: "
            "set add_generation_prompt=False to continue the final message"
        )
    variables = {**tokenizer.special_tokens_map, **kwargs}  # the caller's override the special tokens
    return render(template, messages, tools, documents, add_generation_prompt, continue_final_message, variables)


def _needs_transformers(tokenizer: Any, tools: list[Any] | None, kwargs: dict[str, Any]) -> bool:
    """Whether transformers must render: what this module does not reproduce (see its docstring)."""
    return (
        not isinstance(getattr(tokenizer, "chat_template", None), (str, type(None)))  # named ones: transformers picks
        or any(callable(t) and not isinstance(t, dict) for t in tools or ())
        or any(name in kwargs for name in TRANSFORMERS_ONLY)
    )


def render(
    template: str,
    messages: list[Any],
    tools: list[Any] | None,
    documents: list[Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool | str,
    variables: dict[str, Any],
) -> str:
    """One conversation rendered by ``template``, as transformers' render_jinja_template does."""
    compiled = compile_template(template)
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts) or Python functions with type hints and a docstring")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
    chat = [_without_nones(plain(m)) for m in messages]
    chat = [_with_reasoning_aliases(m) for m in chat]
    cut_at = _tag_final_message(chat, template, continue_final_message) if continue_final_message else None
    text = compiled.render(
        messages=chat,
        tools=plain(tools),
        documents=plain(documents),
        add_generation_prompt=add_generation_prompt,
        **plain(variables),
    )
    return text if cut_at is None else _cut_at_tag(text, cut_at)


def _without_nones(message: Any) -> dict[str, Any]:
    # Clients send content=None or tool_calls=None, which templates render as "None" where
    # they would skip a missing key.
    if not isinstance(message, dict):
        raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    return {k: v for k, v in message.items() if v is not None}


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    # Templates read a message's reasoning under "reasoning_content", gpt-oss's under "thinking":
    # the first given of its names fills both, in this key order.
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(chat: list[dict[str, Any]], template: str, field: bool | str) -> str:
    """Put the tag after the last message's text (``field``: "content", or the one named) and
    return that text, which the rendered chat must then show."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    name = field if isinstance(field, str) else "content"
    final = chat[-1].get(name)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{name}" to continue!')
    fields = [name]
    if name in REASONING_FIELDS:  # copied under each name: tag every copy
        fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(
            f'continue_final_message is set to "{name}" but this is not an accepted field in the chat_template'
        )
    if isinstance(final, (list, tuple)):
        for block in reversed(final):  # the last text part is the one continued
            if "text" in block:
                final = block["text"]
                block["text"] = block["text"] + CONTINUE_TAG
                return str(final)
        raise ValueError("continue_final_message is set but the final message has no text part to continue")
    for f in fields:
        chat[-1][f] = chat[-1][f] + CONTINUE_TAG
    return str(final)


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after applying "
            "the chat template: the template changed or dropped part of it"
        )
    at = text.rindex(CONTINUE_TAG.strip())
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space, and the tag's


def plain(value: Any) -> Any:
    """``value`` rebuilt from JSON types (dicts, lists, tuples, str, int, float, bool, None), as
    transformers' ``_plain_template_data``: a subclass's or an object's methods never reach the
    sandbox; anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar can only come from a caller that imported numpy
    if numpy is not None and isinstance(value, numpy.generic):
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """``template`` compiled in the sandbox (cached: a server renders the same one per request).
    A template that is not valid Jinja is a CtxparError naming its line."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise CtxparError(
            f"the chat template is not valid Jinja (line {e.lineno}: {e.message}): "
            "fix it or pass another with chat_template=..."
        ) from None


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


class GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks what the assistant wrote, for
    transformers' assistant-token mask (which goes to transformers); rendered, its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        block = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
        block.set_lineno(lineno)
        return block

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)  # this class exactly: the server passes its text on


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates: builds dicts, and offers nothing else to reach through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace``, refusing underscore names (a way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # jinja's own signature trick: namespace(self=...) stays a valid attribute name.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )
