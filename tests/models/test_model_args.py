"""ctxpar reads a model's config.json into its own description (ctxpar/model_args.py),
without transformers' config classes, whose modules import torch.distributed.tensor and
more (~1.3 s): every config read both ways (ctxpar's reader on the file, and
transformers' class described) gives the same description; what transformers' classes
would refuse, ctxpar refuses naming the key; a GGUF file and an HF directory loaded in a
fresh process import neither a model's config module nor torch.distributed.tensor, and
generate the same tokens as the model loaded through AutoConfig and AutoTokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError
from ctxpar.hf_overrides import overridden_config_kwargs
from ctxpar.model_args import ModelArgs, from_config_json
from ctxpar.models import gguf, loader
from ctxpar.models.loader import default_model_path
from helpers.deepseek_configs import tiny_deepseek_configs
from helpers.kernel_builds import share_kernel_library
from helpers.models import tiny_configs

HEAVY = ("transformers.models.llama.configuration_llama", "torch.distributed.tensor")
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ARCH["mistral"] = "MistralForCausalLM"
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
SHAPE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}

# config.json files as checkpoints write them: transformers 4's rope keys, extras, windows.
CONFIGS = {
    "llama-defaults": {"model_type": "llama", **SHAPE},
    "llama-rope-theta": {"model_type": "llama", **SHAPE, "rope_theta": 500000.0, "torch_dtype": "bfloat16"},
    "llama-linear": {"model_type": "llama", **SHAPE, "rope_scaling": {"type": "linear", "factor": 2.0}},
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
        "head_dim": 32,
        "tie_word_embeddings": True,
        "eos_token_id": [2, 7],
        "temperature": 0.6,  # a generation parameter: not the model's
        "num_labels": 3,
        "foo": {"bar": 1},
        "attention_bias": True,
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
    "qwen2-window-unused": {"model_type": "qwen2", **SHAPE, "use_sliding_window": False, "sliding_window": 128},
    "qwen3-layer-types": {"model_type": "qwen3", **SHAPE, "head_dim": 16, "layer_types": ["full_attention"] * 3},
    "mistral-v0.1": {"model_type": "mistral", **SHAPE, "sliding_window": 4096},
    "mistral-v0.3": {"model_type": "mistral", **SHAPE, "sliding_window": None},
    "mistral-unstated-window": {"model_type": "mistral", **SHAPE},
}


def write_config(tmp_path: Path, name: str, config: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def transformers_reads(d: Path, **kwargs) -> ModelArgs:
    """The description of the config transformers' own class reads from ``d``."""
    return ModelArgs.of(AutoConfig.from_pretrained(str(d), **kwargs))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_configs_read_as_transformers_reads_them(name: str, tmp_path: Path) -> None:
    d = write_config(tmp_path, name, {"architectures": [ARCH[CONFIGS[name]["model_type"]]], **CONFIGS[name]})
    ours = loader._read_config(d, d)
    assert ours == transformers_reads(d)
    # Written back (a converted GGUF's config.json): the same for ctxpar and for transformers.
    again = write_config(tmp_path, "again", ours.to_config_json())
    assert loader._read_config(again, again) == ours == transformers_reads(again)


def test_the_description_holds_what_the_families_mean() -> None:
    def read(name: str, **more) -> ModelArgs:
        return from_config_json({**CONFIGS[name], **more})

    assert read("qwen2-sliding").qkv_bias and read("qwen2-sliding").sliding_layers == [1, 2]
    assert read("qwen2-window-unused").sliding_window is None
    assert read("qwen3-layer-types").qk_norm and not read("qwen3-layer-types").qkv_bias
    assert read("mistral-v0.1").sliding_layers == [0, 1, 2] == read("mistral-unstated-window").sliding_layers
    assert read("mistral-v0.3").sliding_window is None
    llama3 = read("llama-llama3-own-len").rope
    assert (llama3.rope_type, llama3.factor, llama3.original_max_position_embeddings) == ("llama3", 8.0, 256)
    assert read("llama-extras").eos_token_id == (2, 7) and read("llama-defaults").eos_token_id == (2,)


@pytest.mark.parametrize("name", sorted(tiny_configs()))
def test_saved_transformers_configs_read_as_transformers_reads_them(name: str, tmp_path: Path) -> None:
    tiny_configs()[name].save_pretrained(tmp_path)
    assert loader._read_config(tmp_path, tmp_path) == transformers_reads(tmp_path)


@pytest.mark.parametrize("name", sorted(tiny_deepseek_configs()))
def test_other_model_types_are_read_by_their_transformers_class(name: str, tmp_path: Path) -> None:
    config = tiny_deepseek_configs()[name]
    config.save_pretrained(tmp_path)
    ours = loader._read_config(tmp_path, tmp_path)
    assert ours == ModelArgs.of(config) and ours.is_mla and ours.head_dim == config.qk_rope_head_dim
    assert ours.n_routed_experts == config.n_routed_experts and ours.rope_parameters == config.rope_parameters


def test_a_converted_gguf_config_reads_as_transformers_reads_it() -> None:
    d, temporary = gguf.gguf_to_hf_dir(default_model_path())
    try:
        assert loader._read_config(d, d) == transformers_reads(d)
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
def test_hf_overrides_read_as_transformers_reads_them(overrides: dict, tmp_path: Path) -> None:
    tiny_configs()["llama3_rope"].save_pretrained(tmp_path)
    theirs = AutoConfig.from_pretrained(str(tmp_path))
    want = transformers_reads(tmp_path, **overridden_config_kwargs(theirs, overrides))
    assert loader._read_config(tmp_path, tmp_path, overrides) == want


@pytest.mark.parametrize(
    "bad,words",
    [
        ({"hidden_size": 65}, "hidden_size .65. is not a multiple of num_attention_heads"),
        ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "linear"}}, "needs factor"),
        ({"rope_parameters": {"rope_type": "no-such-rope"}}, "rope_type 'no-such-rope' is unknown"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, "needs high_freq_factor"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be in"),
        ({"layer_types": ["full_attention"]}, "layer_types must name one of"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(bad: dict, words: str, tmp_path: Path) -> None:
    d = write_config(tmp_path, "bad", {"architectures": ["LlamaForCausalLM"], **CONFIGS["llama-defaults"], **bad})
    with pytest.raises(CtxparError, match=rf"cannot read .*config.json: .*{words}"):
        loader._read_config(d, d)


def test_a_config_without_its_shape_is_refused(tmp_path: Path) -> None:
    d = write_config(tmp_path, "bare", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(CtxparError, match="lacks 'hidden_size'"):
        loader._read_config(d, d)


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
    # The kernel library loaded from the usual cache, and put in this one for the fresh process below:
    # its subject is a load's imports, not a kernel build.
    share_kernel_library(tmp_path / "cache")
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
    with monkeypatch.context() as m:  # as transformers reads them: the config by AutoConfig, the tokenizer too
        m.setattr(loader, "READ_HERE", ())
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
        assert type(getattr(new, "hf", new)) is type(old)  # a GGUF's: over transformers' (models/gguf_tokenizer.py)
        text = "Hello, world! <|im_start|>user\nÜber 42"
        assert new(text).input_ids == old(text).input_ids and new.eos_token_id == old.eos_token_id
        chat = [{"role": "user", "content": "Hi"}]
        assert new.apply_chat_template(chat, tokenize=False) == old.apply_chat_template(chat, tokenize=False)
