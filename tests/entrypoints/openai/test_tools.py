"""Tool-call planning and parsing without a server: the parsers give the same calls
fed whole or a character at a time, and bad tools / tool_choice values are 400s."""

from __future__ import annotations

import json

import pytest

from ctxpar.entrypoints.openai.protocol import ApiError
from ctxpar.entrypoints.openai.tools import HermesParser, NamedCall, RequiredCalls, merge_calls, plan_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def run(parser, text: str, piece: int) -> tuple[str, list[dict]]:
    """Feed ``text`` in pieces of ``piece`` characters, then finish; (content, whole calls)."""
    content, entries = "", []
    for i in range(0, len(text), piece):
        c, e = parser.feed(text[i : i + piece])
        content, entries = content + c, entries + e
    c, e = parser.finish()
    return content + c, merge_calls(entries + e)


def strip_ids(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <3 {}"}}\n</tool_call>'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call> <tool_ca'
)


@pytest.mark.parametrize("piece", [1, 3, len(HERMES)])
def test_hermes_calls_and_content_whatever_the_pieces(piece):
    parser = HermesParser()
    content, calls = run(parser, HERMES, piece)
    assert parser.called
    assert content == "Let me check.  <tool_ca"  # text around the calls; a partial tag at the end is text
    assert strip_ids(calls) == [("get_weather", {"city": "Paris <3 {}"}), ("now", {})]


def test_hermes_text_that_is_not_a_call_stays_content():
    parser = HermesParser()
    text = "a <tool_call>not json</tool_call> b <tool_call>{unfinished"
    assert run(parser, text, 2) == (text, [])
    assert not parser.called


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_required_calls_one_per_array_element(piece):
    text = '[{"name": "get_weather", "parameters": {"city": "a\\"]}b"}}, {"name": "now", "parameters": {}}]'
    parser = RequiredCalls()
    content, calls = run(parser, text, piece)
    assert content == "" and parser.called
    assert strip_ids(calls) == [("get_weather", {"city": 'a"]}b'}), ("now", {})]


def test_named_call_streams_its_arguments():
    parser = NamedCall("get_weather")
    first = parser.feed('{"ci')
    assert first[1][0]["function"] == {"name": "get_weather", "arguments": '{"ci'} and "id" in first[1][0]
    assert parser.feed('ty": "x"}')[1] == [{"index": 0, "function": {"arguments": 'ty": "x"}'}}]
    content, calls = run(NamedCall("get_weather"), '{"city": "x"}', 4)
    assert content == "" and strip_ids(calls) == [("get_weather", {"city": "x"})]


def test_plans():
    assert plan_tools(None, None, True, None).constraint is None  # no tools: "none"
    assert plan_tools(TOOLS, "none", True, None).new_parser() is None
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True, None)
    assert json.loads(named.constraint.json) == TOOLS[0]["function"]["parameters"]
    required = plan_tools(TOOLS, "required", False, None)
    schema = json.loads(required.constraint.json)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    # A call's JSON is compact: no runs of whitespace for a small model to fill max_tokens with.
    assert named.constraint.disable_any_whitespace and required.constraint.disable_any_whitespace
    assert isinstance(plan_tools(TOOLS, None, True, "hermes").new_parser(), HermesParser)  # tools: "auto"


@pytest.mark.parametrize(
    "tools, choice, parser, words",
    [
        (TOOLS, "auto", None, "--enable-auto-tool-choice"),
        (TOOLS, None, None, "--enable-auto-tool-choice"),
        (None, "required", None, "needs tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "not among the tools"),
        (TOOLS, "sometimes", None, "tool_choice must be"),
        ([{"type": "retrieval"}], "required", None, r"tools\[0\]"),
        ([{"type": "function", "function": {"name": ""}}], "required", None, "name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "required", None, "parameters"),
    ],
)
def test_bad_tools_are_400s(tools, choice, parser, words):
    with pytest.raises(ApiError, match=words) as e:
        plan_tools(tools, choice, True, parser)
    assert e.value.status == 400
