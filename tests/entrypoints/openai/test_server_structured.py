"""`ctxpar serve` with structured outputs and tool calls, through the official openai client:
JSON that validates (jsonschema), pydantic objects from ``chat.completions.parse``,
tool calls whose arguments validate, streamed and not; a bad schema is a 400 that
leaves concurrent requests as they would have been."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from pydantic import BaseModel, Field

from helpers.server_harness import STOPPED, Server
from helpers.structured import SCHEMAS, check_json

pytestmark = pytest.mark.multiprocess  # starts a server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["a", "b"],
            },
        },
    },
]
NAME = "SmolLM2-135M-Instruct"  # the default model's served name
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--threads", "1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    s = Server(args, log=tmp_path_factory.mktemp("serve_structured") / "server.log")
    yield s
    assert s.stop() in STOPPED, s.log()


def chat(client, stream: bool, **kw):
    """(content, tool calls as (name, arguments dict), finish_reason) of one chat choice."""
    kw = dict(model=NAME, messages=ASK, max_tokens=120, temperature=0) | kw
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments), t.id) for t in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                call = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": ""})
                call["arguments"] += t.function.arguments or ""
            finish = c.finish_reason or finish
    parsed = [(c["name"], json.loads(c["arguments"]), c["id"]) for _, c in sorted(calls.items())]
    return content or None, parsed, finish


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_and_object(server, stream):
    client = server.openai()
    for name in ("nested", "ref"):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
        content, calls, finish = chat(
            client, stream, response_format=fmt, messages=[{"role": "user", "content": "JSON"}]
        )
        check_json(content, SCHEMAS[name])
        assert finish == "stop" and not calls
    content, _, _ = chat(client, stream, response_format={"type": "json_object"}, max_tokens=200)
    assert isinstance(json.loads(content), (dict, list))


def test_parse_returns_a_pydantic_object(server):
    client = server.openai()
    r = client.chat.completions.parse(
        model=NAME,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person,
        max_tokens=80,
        temperature=1.0,
        seed=5,
    )
    assert isinstance(r.choices[0].message.parsed, Person)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_structured_outputs_and_guided_fields(server, stream):
    client = server.openai()
    cases = [
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t)),
        ({"guided_json": SCHEMAS["array"]}, lambda t: check_json(t, SCHEMAS["array"]) is None),
        ({"guided_grammar": 'root ::= "A" | "B" "!"'}, lambda t: t in ("A", "B!")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "e", "schema": SCHEMAS["enum_number"]},
                }
            },
            lambda t: check_json(t, SCHEMAS["enum_number"]) is None,
        ),
    ]
    for extra, ok in cases:
        kw = dict(model=NAME, prompt="Answer:", max_tokens=60, temperature=1.0, seed=1, extra_body=extra)
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        else:
            text = client.completions.create(**kw).choices[0].text
        assert ok(text), (extra, text)


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_calls_validate(server, stream):
    client = server.openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = chat(client, stream, tools=TOOLS, tool_choice=named)
    assert finish == "tool_calls" and content is None
    [(name, args, call_id)] = calls
    assert name == "get_weather" and call_id.startswith("chatcmpl-tool-")
    check_json(json.dumps(args), WEATHER)
    for seed, parallel in ((0, False), (1, True)):
        content, calls, finish = chat(
            client,
            stream,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            parallel_tool_calls=parallel,
            max_tokens=300,
        )
        # A small model may go on calling until max_tokens: each complete call still counts.
        assert finish == ("tool_calls" if not parallel else finish) and calls and content is None
        assert finish in ("tool_calls", "length") and (parallel or len(calls) == 1)
        for name, args, _ in calls:
            check_json(json.dumps(args), PARAMS[name])
        assert len({i for _, _, i in calls}) == len(calls)  # distinct ids


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_calls(server, stream):
    """The model decides: here a regex makes it write a Hermes call, which the parser
    turns into tool_calls; without one, its text is the content."""
    client = server.openai()
    force = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", "unit": "C"\}\}</tool_call>'
    content, calls, finish = chat(client, stream, tools=TOOLS, extra_body={"structured_outputs": {"regex": force}})
    assert finish == "tool_calls" and not content
    [(name, args, _)] = calls
    assert name == "get_weather" and args["unit"] == "C"
    content, calls, finish = chat(client, stream, tools=TOOLS, tool_choice="auto", max_tokens=12)
    assert content and not calls and finish in ("stop", "length")


def test_tool_result_message_is_rendered(server):
    client = server.openai()
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    rendered = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert "21 degrees and sunny" in rendered
    reply = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


def test_bad_schema_is_a_400_and_concurrent_requests_are_unchanged(server):
    client = server.async_openai()
    good = dict(model=NAME, prompt="Answer:", max_tokens=40, temperature=1.0, seed=3)
    good_so = {"guided_json": SCHEMAS["ref"]}

    async def run():
        alone = await client.completions.create(**good, extra_body=good_so)
        bad = [
            {"guided_json": {"type": "foo"}},
            {"guided_regex": "a(b"},
            {"guided_grammar": "start ::= 'x'"},
            {"guided_json": SCHEMAS["ref"], "guided_regex": "a"},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            {"response_format": {"type": "xml"}},
        ]
        results = await asyncio.gather(
            *[client.completions.create(**good, extra_body=good_so) for _ in range(3)],
            *[client.completions.create(**good, extra_body=b) for b in bad],
            return_exceptions=True,
        )
        return alone, results[:3], results[3:]

    alone, together, errors = asyncio.run(run())
    assert all(r.choices[0].text == alone.choices[0].text for r in together)
    for e in errors:
        assert getattr(e, "status_code", None) == 400, e
