"""Request bodies -> SamplingParams, without a server: every field the engine
does not implement is refused at a non-neutral value (the table must cover
each one, so a new field cannot slip through untested)."""

from __future__ import annotations

import json

import pytest

from ctxpar.entrypoints.openai.protocol import ApiError, parse
from ctxpar.entrypoints.openai.protocol_chat import ChatCompletionRequest
from ctxpar.entrypoints.openai.protocol_completions import CompletionRequest
from ctxpar.errors import CtxparError

NON_NEUTRAL = {
    "suffix": "end",
    "prompt_embeds": "AAAA",
    "chat_template": "{{ messages }}",
    "mm_processor_kwargs": {"size": 1},
    "use_beam_search": True,
    "length_penalty": 0.5,
    "logprob_token_ids": [1, 2],
    "logits_processors": ["os.system"],
    "vllm_xargs": {"k": 1},
    "kv_transfer_params": {"do_remote_prefill": True},
    "ec_transfer_params": {"x": 1},
    "repetition_detection": {"max_pattern_size": 4},
    "max_repetition_pattern_size": 4,
    "min_repetition_pattern_size": 2,
    "repetition_min_count": 3,
    "thinking_token_budget": 100,
    "routed_experts_prompt_start": 1,
    "watermarking": True,
}
BASE = {CompletionRequest: {"prompt": "x"}, ChatCompletionRequest: {"messages": [{"role": "user", "content": "x"}]}}
CASES = [(m, f) for m in BASE for f in m.UNSUPPORTED]


def test_table_covers_every_unsupported_field():
    assert {f for _, f in CASES} == set(NON_NEUTRAL)


@pytest.mark.parametrize("model, field", CASES, ids=[f"{m.__name__}.{f}" for m, f in CASES])
def test_unsupported_field_is_refused_by_name(model, field):
    with pytest.raises(ApiError) as e:
        parse(model, json.dumps({**BASE[model], field: NON_NEUTRAL[field]}).encode())
    assert e.value.status == 400 and e.value.param == field and f"{field}=" in e.value.message


@pytest.mark.parametrize("model", list(BASE))
def test_neutral_values_pass(model):
    neutral = {f: v[0][0] for f, v in model.UNSUPPORTED.items()}
    req = parse(model, json.dumps({**BASE[model], **neutral}).encode())
    p = req.sampling_params(10, 100, None)
    assert p.temperature == 1.0 and p.top_k == -1 and p.top_p == 1.0


def test_defaults_and_limits():
    req = parse(CompletionRequest, b'{"prompt": "x", "top_k": 0, "temperature": 0}')
    assert req.sampling_params(10, 100, None).max_tokens == 16  # OpenAI's completions default
    assert req.sampling_params(10, 100, None).top_k == -1  # vLLM: 0 disables too
    chat = parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}]}')
    assert chat.sampling_params(10, 100, None).max_tokens == 90  # the rest of the context
    with pytest.raises(CtxparError, match="maximum context length is 100"):
        parse(CompletionRequest, b'{"prompt": "x", "max_tokens": 91}').sampling_params(10, 100, None)
    with pytest.raises(ApiError, match="max_tokens: Input should be a valid integer"):
        parse(CompletionRequest, b'{"prompt": "x", "max_tokens": "5"}')


def test_penalties_bias_and_vllm_extensions_reach_sampling_params():
    body = {
        "prompt": "x",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"5": 1.0, "7": -300.0},
        "min_tokens": 3,
        "bad_words": ["foo"],
        "allowed_token_ids": [5, 7, 9],
        "include_stop_str_in_output": True,
        "spaces_between_special_tokens": False,
        "n": 3,
    }
    p = parse(CompletionRequest, json.dumps(body).encode()).sampling_params(10, 100, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.5, -0.5, 1.1, 3)
    assert p.logit_bias == {5: 1.0, 7: -100.0}  # clamped to OpenAI's [-100, 100], as vLLM
    assert p.bad_words == ["foo"] and p.allowed_token_ids == [5, 7, 9]
    assert p.include_stop_str_in_output and not p.spaces_between_special_tokens and p.n == 3
    with pytest.raises(CtxparError, match=r"presence_penalty must be in \[-2, 2\]"):
        parse(CompletionRequest, b'{"prompt": "x", "presence_penalty": 3.0}').sampling_params(10, 100, None)
    with pytest.raises(ApiError, match="logit_bias key 'x'"):
        parse(CompletionRequest, b'{"prompt": "x", "logit_bias": {"x": 1.0}}').sampling_params(10, 100, None)


# The fields of vLLM's request models (vllm/entrypoints/openai/completion/protocol.py and
# chat_completion/protocol.py, two versions read for issue 51, and StreamOptions): each is declared
# here, honoured or refused by name (docs/vllm.md, "The server's request fields").
VLLM_SHARED = """model frequency_penalty logit_bias logprobs max_tokens n presence_penalty response_format seed
stop stream stream_options temperature top_p user use_beam_search top_k min_p repetition_penalty length_penalty
stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens
truncate_prompt_tokens prompt_logprobs allowed_token_ids bad_words add_special_tokens structured_outputs priority
request_id logits_processors return_tokens_as_token_ids return_token_ids cache_salt kv_transfer_params vllm_xargs
max_repetition_pattern_size min_repetition_pattern_size repetition_min_count echo""".split()
VLLM_COMPLETION = """prompt suffix watermarking truncation_side logprob_token_ids prompt_embeds session_id
return_token_offsets return_mm_kwargs ec_transfer_params repetition_detection thinking_token_budget stream_interval
routed_experts_prompt_start""".split()
VLLM_CHAT = """messages top_logprobs max_completion_tokens tools tool_choice reasoning_effort include_reasoning
parallel_tool_calls add_generation_prompt continue_final_message documents chat_template chat_template_kwargs
mm_processor_kwargs""".split()


@pytest.mark.parametrize(
    "model, fields",
    [(CompletionRequest, VLLM_SHARED + VLLM_COMPLETION), (ChatCompletionRequest, VLLM_SHARED + VLLM_CHAT)],
    ids=["completions", "chat"],
)
def test_every_vllm_field_is_declared(model, fields):
    assert sorted(set(fields) - set(model.model_fields)) == []
    from ctxpar.entrypoints.openai.protocol import StreamOptions

    assert set(StreamOptions.model_fields) == {"include_usage", "continuous_usage_stats"}


def test_echo_asks_for_prompt_logprobs_and_max_tokens_zero_for_one_token():
    req = parse(CompletionRequest, b'{"prompt": "x", "echo": true, "logprobs": 3, "max_tokens": 0}')
    p = req.sampling_params(10, 100, req.logprobs)
    assert (p.prompt_logprobs, p.logprobs, p.max_tokens) == (3, 3, 1) and req.echo_only
    plain = parse(CompletionRequest, b'{"prompt": "x", "logprobs": 3}').sampling_params(10, 100, 3)
    assert plain.prompt_logprobs is None  # without echo nothing of the prompt is scored
    with pytest.raises(ApiError, match="max_tokens=0"):
        parse(CompletionRequest, b'{"prompt": "x", "max_tokens": 0}')
