"""Tool calling on /v1/chat/completions: tool_choice -> a grammar, generated text -> tool_calls.

    tool_choice        constraint on the output                parser of the text
    "none"             none                                    none: plain content
    {"function": f}    JSON of f's parameters                  NamedCall: the text is f's arguments
    "required"         JSON array of {"name", "parameters"}    RequiredCalls: one call per element
    "auto"             none                                    --tool-call-parser (hermes:
                                                               <tool_call>{json}</tool_call> in the text)

Every parser works on text deltas (``feed``, then ``finish``) and returns the
content delta and OpenAI's ``tool_calls`` delta entries, so streaming sends
them as they come and a whole response merges them (``merge_calls``): one
piece of code for both.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from ctxpar.entrypoints.openai.protocol import ApiError
from ctxpar.structured_params import StructuredOutputsParams

Delta = tuple[str, list[dict[str, Any]]]  # (content text, tool_calls delta entries)


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _entry(index: int, name: str, arguments: str) -> dict[str, Any]:
    """A tool call's first delta entry: id, type, name and (some of) its arguments."""
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolParser(Protocol):
    called: bool  # a tool call was found in the text

    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...


class NamedCall:
    """tool_choice names a function: the whole output is its arguments (the grammar made it valid)."""

    def __init__(self, name: str) -> None:
        self.name, self.called = name, True
        self.started = False

    def feed(self, text: str) -> Delta:
        if not self.started:
            self.started = True
            return "", [_entry(0, self.name, text)]
        return "", ([{"index": 0, "function": {"arguments": text}}] if text else [])

    def finish(self) -> Delta:
        return self.feed("")


class _JsonScanner:
    """Finds where each element of a top-level JSON array ends, in text given piece by piece."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False
        self.buf, self.start = "", -1

    def feed(self, text: str) -> list[str]:
        done = []
        for ch in text:
            self.buf += ch
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.start = len(self.buf) - 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1:
                    done.append(self.buf[self.start :])
        return done


class RequiredCalls:
    """tool_choice "required": the output is [{"name": ..., "parameters": {...}}, ...]; each
    element becomes a call as soon as it is complete."""

    def __init__(self) -> None:
        self.scanner, self.count, self.called = _JsonScanner(), 0, False

    def feed(self, text: str) -> Delta:
        entries = []
        for element in self.scanner.feed(text):
            call = json.loads(element)
            entries.append(_entry(self.count, call["name"], json.dumps(call["parameters"], ensure_ascii=False)))
            self.count += 1
        self.called = self.called or bool(entries)
        return "", entries

    def finish(self) -> Delta:
        return "", []


class HermesParser:
    """tool_choice "auto" with Hermes-style calls (Qwen, SmolLM, NousResearch templates):
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the text.
    Text outside the tags is content; text that may be the start of a tag waits."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.pending, self.inside, self.count, self.called = "", False, 0, False

    def feed(self, text: str) -> Delta:
        self.pending += text
        content = ""
        entries: list[dict[str, Any]] = []
        while True:
            if not self.inside:
                at = self.pending.find(self.START)
                if at < 0:
                    keep = _partial_suffix(self.pending, self.START)
                    content += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep :]
                    return content, entries
                content += self.pending[:at]
                self.pending, self.inside = self.pending[at + len(self.START) :], True
            at = self.pending.find(self.END)
            if at < 0:
                return content, entries
            body, self.pending, self.inside = self.pending[:at], self.pending[at + len(self.END) :], False
            call = _hermes_call(body)
            if call is None:  # not a call after all: the model's text, as it wrote it
                content += self.START + body + self.END
                continue
            entries.append(_entry(self.count, *call))
            self.count += 1
            self.called = True

    def finish(self) -> Delta:
        # An unterminated call or a partial tag at the end is text.
        rest = (self.START if self.inside else "") + self.pending
        self.pending, self.inside = "", False
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _hermes_call(body: str) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


TOOL_PARSERS = {"hermes": HermesParser}


def merge_calls(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Delta entries -> whole tool calls (OpenAI's message.tool_calls)."""
    calls: dict[int, dict[str, Any]] = {}
    for e in entries:
        call = calls.get(e["index"])
        if call is None:
            calls[e["index"]] = {k: v for k, v in e.items() if k != "index"} | {"function": dict(e["function"])}
        else:
            call["function"]["arguments"] += e["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@dataclass
class ToolPlan:
    """What a chat request's tools ask of the engine and of its output."""

    constraint: StructuredOutputsParams | None
    parser: type[ToolParser] | None = None
    name: str | None = None  # the named function

    def new_parser(self) -> ToolParser | None:
        if self.name is not None:
            return NamedCall(self.name)
        return self.parser() if self.parser is not None else None


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{name: parameters schema} of the request's tools; a 400 on a malformed tool."""
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"tools[{i}].function.name must be a non-empty string", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        out[name] = params
    return out


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool, auto_parser: str | None
) -> ToolPlan:
    """The constraint and parser of a request's tools and tool_choice (OpenAI's rules: no
    tools means "none"; tools without tool_choice means "auto")."""
    functions = _functions(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ToolPlan(None)
    if not functions:
        raise ApiError(400, f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
    if tool_choice == "auto":
        if auto_parser is None:
            raise ApiError(
                400,
                '"auto" tool choice needs the server started with --enable-auto-tool-choice and --tool-call-parser; '
                'or send tool_choice "required", "none" or a named function',
                param="tool_choice",
            )
        return ToolPlan(None, parser=TOOL_PARSERS[auto_parser])
    # A call's grammar is compact JSON (json.dumps' layout): with any whitespace allowed between
    # tokens a small model can write newlines until max_tokens and lose the call it was making.
    if tool_choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
            for name, params in functions.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(StructuredOutputsParams(json=schema, disable_any_whitespace=True), parser=RequiredCalls)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in functions:
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return ToolPlan(StructuredOutputsParams(json=functions[name], disable_any_whitespace=True), name=name)
