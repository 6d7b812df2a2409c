"""A load reads Llama-family configs with ctxpar's copies of transformers' config
classes (models/light_config.py's ``light_config_class``), not transformers' own, whose
modules import torch.distributed.tensor and more (~1.3 s): each copy against
transformers' class, field by field, and every config read both ways; a GGUF
file and an HF directory loaded in a fresh process import neither class nor
torch.distributed.tensor, and generate the same tokens as the model loaded
through AutoConfig and AutoTokenizer in this one."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError
from ctxpar.hf_overrides import overridden_config_kwargs
from ctxpar.models import gguf, loader
from ctxpar.models.light_config import LIGHT_CONFIGS_OF, light_config_class
from ctxpar.models.loader import default_model_path
from helpers.models import tiny_configs

THEIRS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
HEAVY = ("transformers.models.llama.configuration_llama", "torch.distributed.tensor")
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "max_position_embeddings": 512}

# config.json files as checkpoints write them: bare, transformers 4's rope keys, extras.
CONFIGS = {
    "llama-bare": {"model_type": "llama"},
    "qwen2-bare": {"model_type": "qwen2"},
    "qwen3-bare": {"model_type": "qwen3"},
    "llama-rope-theta": {"model_type": "llama", **SHAPE, "rope_theta": 500000.0, "torch_dtype": "bfloat16"},
    "llama-linear": {
        "model_type": "llama",
        **SHAPE,
        "rope_theta": 1e4,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    },
    "llama-llama3": {"model_type": "llama", **SHAPE, "rope_theta": 5e5, "rope_scaling": LLAMA3},
    "llama-llama3-own-len": {
        "model_type": "llama",
        **SHAPE,
        "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 128},
        "original_max_position_embeddings": 256,
    },
    "llama-yarn-parameters": {
        "model_type": "llama",
        **SHAPE,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
    },
    "llama-extras": {
        "model_type": "llama",
        **SHAPE,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
        "eos_token_id": [2, 7],
        "temperature": 0.6,  # a generation parameter: dropped
        "num_labels": 3,
        "foo": {"bar": 1},
        "partial_rotary_factor": 0.5,
        "dtype": "float16",
    },
    "qwen2-sliding": {
        "model_type": "qwen2",
        **SHAPE,
        "use_sliding_window": True,
        "sliding_window": 128,
        "max_window_layers": 1,
        "rope_theta": 1e6,
    },
    "qwen3-layer-types": {"model_type": "qwen3", **SHAPE, "layer_types": ["full_attention"] * 3},
}


def write_config(tmp_path: Path, name: str, config: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def same_config(ours, theirs) -> None:
    assert type(ours) is light_config_class(theirs.model_type)  # read by the copy, not by AutoConfig
    assert type(ours).__name__ == type(theirs).__name__ and ours.model_type == theirs.model_type
    assert ours.__dict__ == theirs.__dict__
    assert ours.to_dict() == theirs.to_dict() and ours.to_json_string() == theirs.to_json_string()
    again = pickle.loads(pickle.dumps(ours))
    assert type(again) is type(ours) and again.__dict__ == ours.__dict__


def test_the_copies_are_of_this_transformers() -> None:
    assert transformers.__version__.startswith(LIGHT_CONFIGS_OF), (
        f"transformers {transformers.__version__}: compare models/light_config.py's config classes with this "
        "release's, then add it to LIGHT_CONFIGS_OF"
    )


@pytest.mark.parametrize("model_type", sorted(THEIRS))
def test_each_copy_has_the_fields_and_defaults_of_transformers_class(model_type: str) -> None:
    ours, theirs = light_config_class(model_type), THEIRS[model_type]
    assert [(f.name, f.default) for f in dataclasses.fields(ours)] == [
        (f.name, f.default) for f in dataclasses.fields(theirs)
    ]
    same_config(ours(), theirs())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_configs_read_as_autoconfig_reads_them(name: str, tmp_path: Path) -> None:
    d = write_config(tmp_path, name, {"architectures": [ARCH[CONFIGS[name]["model_type"]]], **CONFIGS[name]})
    same_config(loader._read_config(d, d), AutoConfig.from_pretrained(str(d)))


@pytest.mark.parametrize("name", sorted(tiny_configs()))
def test_saved_transformers_configs_read_as_autoconfig_reads_them(name: str, tmp_path: Path) -> None:
    tiny_configs()[name].save_pretrained(tmp_path)
    same_config(loader._read_config(tmp_path, tmp_path), AutoConfig.from_pretrained(str(tmp_path)))


def test_a_converted_gguf_config_reads_as_autoconfig_reads_it() -> None:
    d, temporary = gguf.gguf_to_hf_dir(default_model_path())
    try:
        same_config(loader._read_config(d, d), AutoConfig.from_pretrained(str(d)))
    finally:
        if temporary:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "max_position_embeddings": 300},
        {"rms_norm_eps": 1e-5, "unknown_key": 3},
    ],
)
def test_hf_overrides_read_as_autoconfig_reads_them(overrides: dict, tmp_path: Path) -> None:
    tiny_configs()["llama3_rope"].save_pretrained(tmp_path)
    theirs = AutoConfig.from_pretrained(str(tmp_path))
    theirs = AutoConfig.from_pretrained(str(tmp_path), **overridden_config_kwargs(theirs, overrides))
    same_config(loader._read_config(tmp_path, tmp_path, overrides), theirs)


@pytest.mark.parametrize(
    "bad", [{"hidden_size": 65}, {"hidden_size": "64"}, {"rope_parameters": {"rope_type": "linear"}}]
)
def test_configs_transformers_refuses_are_refused(bad: dict, tmp_path: Path) -> None:
    d = write_config(tmp_path, "bad", {"architectures": ["LlamaForCausalLM"], **CONFIGS["llama-extras"], **bad})
    with pytest.raises(Exception):  # noqa: B017 - whichever transformers raises
        AutoConfig.from_pretrained(str(d))
    with pytest.raises(CtxparError, match=r"cannot read .*config.json"):
        loader._read_config(d, d)


def test_other_model_types_and_remote_code_are_read_by_autoconfig(tmp_path: Path) -> None:
    assert light_config_class("deepseek_v3") is None and light_config_class(None) is None
    d = write_config(tmp_path, "remote", {**CONFIGS["llama-bare"], "auto_map": {"AutoConfig": "x.XConfig"}})
    assert type(loader._read_config(d, d)) is LlamaConfig  # the local class: no trust_remote_code


# A fresh process: the modules a load imports, and the tokens it generates.
LOAD = """
import json, sys
from ctxpar import LLM, SamplingParams
gguf_file, hf_dir = sys.argv[1:]
llm = LLM(model=gguf_file, max_model_len=256, enable_prefix_caching=False, kv_cache_bytes=1 << 22)
after_gguf = [m for m in {heavy!r} if m in sys.modules]
out = llm.generate([{prompt!r}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
LLM(model=hf_dir, max_model_len=256, kv_cache_bytes=1 << 22)
after_hf = [m for m in {heavy!r} if m in sys.modules]
print(json.dumps([after_gguf, after_hf, list(out[0].outputs[0].token_ids)]))
"""
PROMPT = "The light config loads"


@pytest.fixture
def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from ctxpar.bench import gguf_shapes
    from ctxpar.bench.gguf_shapes import Shape, write_gguf

    monkeypatch.setitem(gguf_shapes.SHAPES, "tiny", Shape(256, 2, 4, 2, 64, 512, 10000.0, tied=False))
    monkeypatch.setenv("CTXPAR_CACHE", str(tmp_path / "cache"))
    return write_gguf("tiny", "Q4_0", tmp_path / "tiny.gguf", default_model_path())


def greedy(model: str) -> list[int]:
    with LLM(model=model, max_model_len=256, enable_prefix_caching=False, kv_cache_bytes=1 << 22) as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_a_load_imports_no_model_config_module_and_generates_as_before(
    tiny_gguf: Path, tiny_model_dirs: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = greedy(str(tiny_gguf))  # also converts the file once: the tokenizer, built by AutoTokenizer
    converted, temporary = gguf.gguf_to_hf_dir(tiny_gguf)
    assert not temporary
    hf_dir = tmp_path / "hf"  # an HF checkpoint with a tokenizer, which AutoTokenizer loads
    shutil.copytree(tiny_model_dirs["llama"], hf_dir)
    for f in converted.iterdir():
        if f.name not in ("config.json", gguf.MARKER):
            shutil.copy(f, hf_dir)
    with monkeypatch.context() as m:  # as before: the config by AutoConfig, the tokenizer by AutoTokenizer
        m.setattr(loader, "light_config_class", lambda model_type: None)
        m.setattr(loader, "_saved_tokenizer_class", lambda d: None)
        before = greedy(str(tiny_gguf))
        old_tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    assert mine == before

    script = LOAD.format(heavy=HEAVY, prompt=PROMPT)
    env = {**os.environ, "CTXPAR_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_gguf), str(hf_dir)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    after_gguf, after_hf, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert after_gguf == [] and after_hf == [], (after_gguf, after_hf)
    assert tokens == before

    # The tokenizers the light paths load are AutoTokenizer's.
    for d, old in ((converted, AutoTokenizer.from_pretrained(str(converted))), (hf_dir, old_tokenizer)):
        config = loader._read_config(d, d)
        new = loader._load_tokenizer(d, d, config, converted_gguf=d == converted)
        assert type(new) is type(old)
        text = "Hello, world! <|im_start|>user\nÜber 42"
        assert new(text).input_ids == old(text).input_ids and new.eos_token_id == old.eos_token_id
        chat = [{"role": "user", "content": "Hi"}]
        assert new.apply_chat_template(chat, tokenize=False) == old.apply_chat_template(chat, tokenize=False)
