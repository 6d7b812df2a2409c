"""vLLM's offline LLM API: constructor arguments, prompt formats, chat options,
use_tqdm, generation-config defaults (issue 12). Beam search: test_beam_search.py."""

from __future__ import annotations

import functools
import io
import json
import logging
import shutil

import pytest

from ctxpar import LLM, SamplingParams, TextPrompt, TokensPrompt
from ctxpar.engine.vllm_args import HINTS
from ctxpar.errors import CtxparError
from helpers.tiny_tokenizer import with_byte_tokenizer

SMALL = dict(max_model_len=128, kv_cache_bytes=1 << 22, enable_prefix_caching=False)
GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def text_dir(tiny_model_dirs, tmp_path_factory):
    """The tiny llama with the byte tokenizer (a token per byte) and its chat template."""
    return with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("llm_api") / "llama_bytes")


@pytest.fixture(scope="module")
def llm(text_dir):
    with LLM(str(text_dir), **SMALL) as llm:
        yield llm


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# -- constructor arguments ------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"tensor_parallel_size": 2}, ["tensor_parallel_size=2", "pcp_size"]),
        ({"tensor_parallel_size": True}, ["tensor_parallel_size=True"]),
        ({"quantization": "awq"}, ["quantization='awq'", ".gguf"]),
        ({"enable_lora": True}, ["enable_lora=True", "merge"]),
        ({"pipeline_parallel_size": 2}, ["pipeline_parallel_size=2"]),
        ({"kv_cache_dtype": "fp4"}, ["kv_cache_dtype", "'fp4'", "'int8'", "'fp8_e5m2'"]),
        ({"revision": "main"}, ["revision='main'", "local"]),
        ({"tokenizer_mode": "mistral"}, ["tokenizer_mode='mistral'"]),
        ({"generation_config": "/nonexistent/dir"}, ["generation_config", "generation_config.json", "'vllm'"]),
        ({"generation_config": 3}, ["generation_config must be"]),
        ({"tokenizer": "/nonexistent/tok"}, ["tokenizer='/nonexistent/tok'", "directory"]),
        ({"trust_remote_code": "yes"}, ["trust_remote_code must be True or False"]),
        ({"seed": -1}, ["seed"]),
    ],
)
def test_refused_constructor_arguments_fail_before_loading(tmp_path, kwargs, words):
    # The model path does not exist: each error must come before the model is looked at.
    with pytest.raises(CtxparError) as e:
        LLM(str(tmp_path / "no-model"), **kwargs)
    for w in words:
        assert w in str(e.value)


def test_hints_are_ignored_with_one_log_line_and_neutral_values_accepted(text_dir, llm, caplog):
    hints = dict(disable_log_stats=True, gpu_memory_utilization=0.5, swap_space=0, max_seq_len_to_capture=8192)
    neutral = dict(
        tensor_parallel_size=1,
        quantization=None,
        enable_lora=False,
        kv_cache_dtype="auto",
        trust_remote_code=True,
        seed=None,
    )
    with caplog.at_level(logging.WARNING, logger="ctxpar"):
        other = LLM(str(text_dir), **SMALL, **hints, **neutral)
    with other:
        lines = [r.getMessage() for r in caplog.records]
        for name in hints:
            assert sum(f"ignoring {name}=" in line for line in lines) == 1, lines
        assert other.config.seed == 0  # seed=None: vLLM's default seed, 0
        prompt = {"prompt_token_ids": [5, 6, 7]}
        same = tokens(llm.generate(prompt, GREEDY, use_tqdm=False))
        assert tokens(other.generate(prompt, GREEDY, use_tqdm=False)) == same


def test_docs_list_every_vllm_argument():
    from pathlib import Path

    from ctxpar.engine.vllm_args import REFUSED

    doc = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    missing = [name for name in [*HINTS, *REFUSED] if f"`{name}`" not in doc]
    assert not missing, f"docs/vllm.md does not mention {missing}"


def test_tokenizer_argument_and_skip_tokenizer_init(tiny_model_dirs, text_dir, llm):
    # The bare tiny llama has no tokenizer: tokenizer= lends it the byte tokenizer of text_dir.
    with LLM(str(tiny_model_dirs["llama"]), tokenizer=str(text_dir), **SMALL) as lent:
        [out] = lent.generate("Hi", GREEDY, use_tqdm=False)
        assert out.prompt_token_ids == list(b"Hi")
        assert tokens([out]) == tokens(llm.generate("Hi", GREEDY, use_tqdm=False))
        assert out.outputs[0].text == llm.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].text
    with LLM(str(text_dir), skip_tokenizer_init=True, **SMALL) as bare:
        assert bare.get_tokenizer() is None
        with pytest.raises(CtxparError, match="no tokenizer"):
            bare.generate("Hi", GREEDY, use_tqdm=False)
        [out] = bare.generate(TokensPrompt(prompt_token_ids=list(b"Hi")), GREEDY, use_tqdm=False)
        assert tokens([out]) == tokens(llm.generate("Hi", GREEDY, use_tqdm=False)) and out.outputs[0].text == ""


# -- prompts --------------------------------------------------------------------


def test_prompt_formats_give_the_same_tokens(llm):
    ids = list(b"Hello")
    forms = [
        "Hello",
        {"prompt": "Hello"},
        TextPrompt(prompt="Hello"),
        {"prompt_token_ids": ids},
        TokensPrompt(prompt_token_ids=ids),
        TokensPrompt(prompt_token_ids=ids, prompt="Hello"),
    ]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert all(o.prompt_token_ids == ids for o in outs)
    assert all(t == tokens(outs)[0] for t in tokens(outs))
    assert [o.prompt for o in outs] == ["Hello"] * 3 + [None, None, "Hello"]


@pytest.mark.parametrize(
    "prompt, words",
    [
        ({"prompt": "x", "multi_modal_data": {}}, ["multi_modal_data", "text-only"]),
        ({"promt": "x"}, ["unknown prompt key 'promt'"]),
        ({}, ["'prompt'", "'prompt_token_ids'"]),
        ({"prompt": 5}, ["'prompt' must be a string"]),
        (5, ["TextPrompt", "TokensPrompt", "int"]),
    ],
)
def test_bad_prompts_are_refused(llm, prompt, words):
    with pytest.raises(CtxparError) as e:
        llm.generate([{"prompt_token_ids": [1]}, prompt], GREEDY, use_tqdm=False)
    for w in words:
        assert w in str(e.value)
    assert not llm.engine.has_unfinished_requests()


# -- chat -----------------------------------------------------------------------


def test_chat_options_render_as_the_template_says(llm, tmp_path):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    render = functools.partial(llm.apply_chat_template, conv)
    # tiny_tokenizer.CHAT_TEMPLATE: "<role>content\n" per message, then "<assistant>" for a generation prompt.
    assert render()[0]["prompt"] == "<user>hi\n<assistant>yo\n<assistant>"
    assert render(add_generation_prompt=False)[0]["prompt"] == "<user>hi\n<assistant>yo\n"
    assert render(add_generation_prompt=False, continue_final_message=True)[0]["prompt"] == "<user>hi\n<assistant>yo"
    with pytest.raises(CtxparError, match="add_generation_prompt=False"):
        render(continue_final_message=True)
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ suffix }}"
    assert render({"suffix": "!"}, chat_template=own)[0]["prompt"] == "[hi][yo]!"
    (tmp_path / "t.jinja").write_text(own)
    assert render({"suffix": "?"}, chat_template=str(tmp_path / "t.jinja"))[0]["prompt"] == "[hi][yo]?"
    with pytest.raises(CtxparError, match="tokenize"):
        render({"tokenize": True})
    # "openai": content reaches the template as a list of text parts.
    parts = "{% for m in messages %}{% for p in m['content'] %}({{ p['text'] }}){% endfor %}{% endfor %}"
    assert render(chat_template=parts, chat_template_content_format="openai")[0]["prompt"] == "(hi)(yo)"
    with pytest.raises(CtxparError, match="chat_template_content_format"):
        render(chat_template_content_format="xml")
    [p] = render()
    assert p["prompt_token_ids"] == list(p["prompt"].encode())  # the template's text, no extra special tokens


def test_chat_content_parts_and_conversation_lists(llm):
    one = [{"role": "user", "content": "a\nb"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    other = [{"role": "user", "content": "c"}]
    outs = llm.chat([one, parts, other], GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == list(b"<user>a\nb\n<assistant>")
    assert outs[2].prompt_token_ids == list(b"<user>c\n<assistant>")
    assert tokens(outs)[0] == tokens(outs)[1]
    [single] = llm.chat(one, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert single.prompt_token_ids == list(b"<user>a\nb\n")
    with pytest.raises(CtxparError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)


# -- use_tqdm -------------------------------------------------------------------


def test_use_tqdm_takes_a_bool_or_a_bar_maker(llm):
    from tqdm import tqdm

    sink = io.StringIO()
    seen = {}

    def make_bar(*args, **kwargs):
        seen.update(kwargs)
        return tqdm(*args, file=sink, **kwargs)

    prompts = [{"prompt_token_ids": [i + 1, 2]} for i in range(3)]
    quiet = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=make_bar)) == quiet
    assert seen["total"] == 3 and "Processed prompts" in sink.getvalue() and "3/3" in sink.getvalue()
    with pytest.raises(CtxparError, match="use_tqdm"):
        llm.generate(prompts, GREEDY, use_tqdm="yes")


# -- generation config ------------------------------------------------------------


def with_generation_config(src, dst, config: dict):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(config))
    return dst


def test_default_sampling_params_follow_generation_config(text_dir, tmp_path):
    recommended = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "max_new_tokens": 5,
        "do_sample": True,
        "bos_token_id": 1,
    }
    model = with_generation_config(text_dir, tmp_path / "m", recommended)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "max_new_tokens": 3}))
    with LLM(str(model), **SMALL) as auto:
        sp = auto.get_default_sampling_params()
        assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens) == (0.6, 0.9, 20, 0.05, 5)
        assert auto.get_default_sampling_params() is not sp  # a new object each time, as vLLM
        # No sampling_params: the defaults, with the engine's seed as usual.
        [out] = auto.generate({"prompt_token_ids": [3, 4]}, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 5  # the tiny model has no EOS: max_new_tokens decides
        [ref] = auto.generate({"prompt_token_ids": [3, 4]}, auto.get_default_sampling_params(), use_tqdm=False)
        assert len(ref.outputs[0].token_ids) == 5
    neutral = SamplingParams()
    with LLM(str(model), generation_config="vllm", **SMALL) as plain:
        sp = plain.get_default_sampling_params()
        assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens) == (
            neutral.temperature,
            neutral.top_p,
            neutral.top_k,
            neutral.min_p,
            neutral.max_tokens,
        )
    with LLM(str(model), generation_config=str(other), override_generation_config={"top_p": 0.5}, **SMALL) as moved:
        sp = moved.get_default_sampling_params()
        assert (sp.temperature, sp.top_p, sp.max_tokens, sp.top_k) == (0.3, 0.5, 3, neutral.top_k)


@pytest.mark.skipif(
    "repetition_penalty" not in SamplingParams.__dataclass_fields__,
    reason="SamplingParams.repetition_penalty comes with issue 12's sampling half",
)
def test_generation_config_repetition_penalty(text_dir, tmp_path):
    model = with_generation_config(text_dir, tmp_path / "m", {"repetition_penalty": 1.1})
    with LLM(str(model), **SMALL) as llm:
        assert llm.get_default_sampling_params().repetition_penalty == 1.1


def test_bad_generation_config_is_named_before_loading(text_dir, tmp_path):
    model = shutil.copytree(text_dir, tmp_path / "m")
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(CtxparError, match="generation_config.json"):
        LLM(str(model), **SMALL)
    (model / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    with pytest.raises(CtxparError) as e:
        LLM(str(model), **SMALL)
    assert "temperature" in str(e.value) and "generation_config='vllm'" in str(e.value)


def test_lora_request_is_refused(llm):
    for call in (llm.generate, llm.chat):
        with pytest.raises(CtxparError, match="lora_request is not supported.*merge_and_unload"):
            call([{"role": "user", "content": "hi"}] if call == llm.chat else "hi", GREEDY, False, object())
    assert not llm.engine.has_unfinished_requests()
