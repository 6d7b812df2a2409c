"""Chat templates rendered by ctxpar with jinja2 alone (entrypoints/chat_template.py) against
transformers' ``apply_chat_template(..., tokenize=False)`` on the same template, messages and
special tokens: the templates of many families as their tokenizer_config.json files ship them
(llama.cpp's models/templates, from the llama-cpp-python sdist the tests already download),
each given system/user/assistant turns, several turns, add_generation_prompt on and off,
continue_final_message, tools and tool calls, thinking switched off, reasoning and documents.
Texts must be equal; where transformers refuses, ctxpar must refuse with the same exception
type. The sandbox is transformers': attack templates are refused by both."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jinja2
import pytest

from ctxpar.entrypoints.chat_template import apply_chat_template
from ctxpar.errors import CtxparError
from helpers.llama_cpp import chat_templates
from helpers.tiny_tokenizer import byte_tokenizer

FAMILIES = [
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct",
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B",
    "Qwen-QwQ-32B",
    "Qwen3-Coder",
    "google-gemma-2-2b-it",
    "google-gemma-4-31B-it",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "unsloth-mistral-Devstral-Small-2507",
    "microsoft-Phi-3.5-mini-instruct",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-V3.1",
    "openai-gpt-oss-120b",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "HuggingFaceTB-SmolLM3-3B",
    "CohereForAI-c4ai-command-r-plus-tool_use",
    "ibm-granite-granite-3.3-2B-Instruct",
]
# Families whose templates write the tools they are given into the prompt.
WRITE_TOOLS = ("Llama-3.1", "Llama-3.2", "Llama-3.3", "Qwen2.5", "Qwen3-0.6B", "Hermes-3", "gpt-oss")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "a city's <name> & 'quoted' ü"}},
                "required": ["city"],
            },
        },
    }
]
ASK = {"role": "user", "content": "Weather in Paris?"}
CALL = {
    "role": "assistant",
    "content": None,  # as OpenAI clients send it: dropped, as transformers drops it
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'}
CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "user": ([{"role": "user", "content": "Hi there"}], {}),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü 中文 </s> {{ x }}"}], {}),
    "turns": (
        [
            {"role": "user", "content": "A?"},
            {"role": "assistant", "content": "B."},
            {"role": "user", "content": "C?"},
        ],
        {},
    ),
    "no_generation_prompt": (
        [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "B."}],
        {"add_generation_prompt": False},
    ),
    "continue": (
        [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "The answer is "}],
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
    "tools": ([{"role": "system", "content": "S"}, ASK], {"tools": TOOLS}),
    "tool_call": ([ASK, CALL, RESULT], {"tools": TOOLS}),
    "tool_call_string_args": (
        [
            ASK,
            {
                **CALL,
                "tool_calls": [
                    {**CALL["tool_calls"][0], "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
                ],
            },
            RESULT,
        ],  # fmt: skip
        {"tools": TOOLS},
    ),
    "thinking_off": ([{"role": "user", "content": "A?"}], {"enable_thinking": False}),
    "thinking_on": ([{"role": "user", "content": "A?"}], {"enable_thinking": True}),
    "reasoning": (
        [
            {"role": "user", "content": "A?"},
            {"role": "assistant", "content": "B.", "reasoning_content": "hmm"},
            {"role": "user", "content": "C?"},
        ],
        {},
    ),
    "documents": ([{"role": "user", "content": "A?"}], {"documents": [{"title": "T", "text": "X"}]}),
    "parts_continue": (
        [
            {"role": "user", "content": [{"type": "text", "text": "A?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "The answer is "}]},
        ],
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
    "reasoning_continue": (
        [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "", "reasoning_content": "Let me "}],
        {"add_generation_prompt": False, "continue_final_message": "reasoning_content"},
    ),
}


@functools.cache
def tokenizer() -> Any:
    """transformers' tokenizer (the tests' byte one) with a BOS and an EOS for templates to write."""
    tok = byte_tokenizer()
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    return tok


def outcome(render: Callable[[], str]) -> tuple[str, str]:
    """("ok", text) or ("error", the exception's type name)."""
    try:
        return "ok", render()
    except Exception as e:
        return "error", type(e).__name__


def both(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[tuple[str, str], tuple[str, str]]:
    """transformers' outcome and ctxpar's for the same call."""
    tok = tokenizer()
    kwargs = {"add_generation_prompt": True, **kwargs}
    ref = outcome(lambda: tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs))
    ours = outcome(lambda: apply_chat_template(tok, messages, template, **kwargs))
    return ref, ours


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_renders_as_transformers(family: str) -> None:
    template = (chat_templates() / f"{family}.jinja").read_text()
    rendered = {}
    for name, (messages, kwargs) in CASES.items():
        ref, ours = both(template, messages, **kwargs)
        assert ours == ref, (family, name)
        rendered[name] = ref
    plain = ("tools",) if family.endswith("tool_use") else ("user", "turns", "no_generation_prompt")
    for name in plain:  # every family renders a plain chat (a tool_use template one with tools)
        assert rendered[name][0] == "ok", (family, name)
    if any(f in family for f in WRITE_TOOLS):
        assert "get_weather" in rendered["tools"][1], family
    if "Qwen3-0.6B" in family:  # enable_thinking reached the template
        assert rendered["thinking_off"] != rendered["thinking_on"]


def test_the_special_tokens_and_variables_reach_the_template() -> None:
    template = "{{ bos_token }}|{{ eos_token }}|{{ extra }}|{{ messages[0]['content'] }}|{{ tools | tojson(indent=2) }}"
    ref, ours = both(template, [{"role": "user", "content": "x"}], extra="<&>", tools=TOOLS)
    assert ref[0] == "ok" and ours == ref
    ref, ours = both(template, [{"role": "user", "content": "x"}], bos_token="override")  # the caller's win
    assert ref[1].startswith("override|") and ours == ref


def test_the_sandboxs_extensions_and_globals_render_as_transformers() -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'skip' %}{% continue %}"
        "{% endif %}{% generation %}[{{ m.content }}]{% endgeneration %}\n  {% endfor %}"
        "{% set ns = namespace(n=0, self=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{{ ns.self }}"
        "{{ dict(a=1, b=[2, '<3>']) | tojson(ensure_ascii=True, sort_keys=True, separators=(',', ':')) }}"
        "{{ dict.fromkeys(['x', 'y'], 0) | tojson }}{{ strftime_now('%Y') }}{{ messages | length }}"
    )
    messages = [{"role": "skip", "content": "s"}, {"role": "user", "content": "ü"}, {"role": "user", "content": "b"}]
    ref, ours = both(template, messages)
    assert ref[0] == "ok" and "[ü]" in ref[1] and "[b]" not in ref[1] and ours == ref


def test_tools_given_as_functions_are_rendered_by_transformers() -> None:
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name
        """
        return city

    ref, ours = both("{{ tools | tojson }}", [{"role": "user", "content": "x"}], tools=[get_weather])
    assert ref[0] == "ok" and '"city"' in ref[1] and ours == ref


ATTACKS = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ dict.__call__.__globals__ }}",
    "{% set ns = namespace(_x=1) %}{{ ns }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns }}",
    "{{ messages.append({'role': 'system'}) }}",
    "{{ messages[0].update(role='system') }}",
    "{{ strftime_now.__code__ }}",
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_an_attack_template_is_refused_as_transformers_refuses_it(attack: str) -> None:
    ref, ours = both(attack, [{"role": "user", "content": "x"}])
    assert ref in (("error", "SecurityError"), ("ok", "")), ref  # refused, or an undefined name: nothing leaks
    assert ours == ref
    if ours[0] == "error":  # and the error is jinja's sandbox's own
        with pytest.raises(jinja2.exceptions.SecurityError):
            apply_chat_template(tokenizer(), [{"role": "user", "content": "x"}], attack, add_generation_prompt=True)


def test_an_invalid_template_is_an_error_naming_its_line() -> None:
    with pytest.raises(CtxparError, match=r"not valid Jinja \(line 2: .*\): fix it or pass another"):
        apply_chat_template(tokenizer(), [{"role": "user", "content": "x"}], "{% for m in messages %}\n{{ m }")


def test_a_templates_refusal_keeps_its_class_and_text() -> None:
    # The server passes a TemplateError of this class exactly on to the client (openai/failures.py).
    with pytest.raises(jinja2.TemplateError) as e:
        apply_chat_template(tokenizer(), [{"role": "user", "content": "x"}], "{{ raise_exception('roles!') }}")
    assert type(e.value) is jinja2.TemplateError and str(e.value) == "roles!"
