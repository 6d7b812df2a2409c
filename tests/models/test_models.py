"""Llama-family models against the transformers forward pass of the same weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ctxpar.errors import CtxparError
from ctxpar.layers.forward_context import ForwardContext
from ctxpar.models.llama import LlamaForCausalLM
from ctxpar.models.loader import load_model
from ctxpar.models.registry import ARCHITECTURES, get_model_class, model_class_for_config, supported_architectures
from helpers.reference import SingleSequence

NAMES = ["llama", "llama3_rope", "qwen2", "qwen3"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def pairs(tiny_model_dirs):
    """{name: (ctxpar model, transformers model)} over the same checkpoint."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name in NAMES:
        d = tiny_model_dirs[name]
        ours = load_model(str(d), torch.float32, torch.device("cpu")).model
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        out[name] = (ours, ref)
    return out


def prompt(n: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def reference_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    return ref(ids[None]).logits[0].float()  # (n, vocab)


@pytest.mark.parametrize("name", NAMES)
def test_prefill_matches_transformers(pairs, name):
    ours, ref = pairs[name]
    ids = prompt()
    expected = reference_logits(ref, ids)
    got = SingleSequence(ours, 32).step(ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_and_decode_match_transformers(pairs, name, kernels, monkeypatch):
    """With the compiled kernels (attention, RMSNorm, rope, SiLU·up) and on
    PyTorch's path (CTXPAR_KERNELS=0)."""
    monkeypatch.setenv("CTXPAR_KERNELS", kernels)
    ours, ref = pairs[name]
    ids = prompt(seed=1)
    expected = reference_logits(ref, ids)
    two_chunks = SingleSequence(ours, 32)
    got = torch.cat([two_chunks.step(ids[:11]), two_chunks.step(ids[11:])])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    decode = SingleSequence(ours, 32)
    got = torch.cat([decode.step(ids[:4])] + [decode.step(ids[i : i + 1]) for i in range(4, len(ids))])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_batch_of_rows_with_padding(pairs, name):
    """Three rows in one step (continued prefill, fresh prefill, decode) plus padding tokens."""
    ours, ref = pairs[name]
    a, b, c = prompt(14, seed=2), prompt(5, seed=3), prompt(9, seed=4)
    exp_a, exp_b, exp_c = (reference_logits(ref, x) for x in (a, b, c))
    caches = [torch.zeros(64, *ours.kv_entry_shape) for _ in range(ours.num_kv_layers)]
    base = {"a": 0, "b": 20, "c": 40}  # each sequence's slot = base + position
    # Earlier step: a's first 8 tokens and c's first 8 tokens.
    warm = ForwardContext(
        query_start_loc=[0, 8, 16],
        start_pos=[0, 0],
        seq_lens=[8, 8],
        context_slots=[torch.arange(8), torch.arange(8) + base["c"]],
        write_src=None,
        write_slots=torch.cat([torch.arange(8), torch.arange(8) + base["c"]]),
        kv_caches=caches,
    )
    with torch.inference_mode():
        ours.forward(torch.cat([a[:8], c[:8]]), torch.cat([torch.arange(8), torch.arange(8)]), warm)
        # This step: decode c at 8, a continues at 8..13, b fresh 0..4, then 2 padding tokens.
        ids = torch.cat([c[8:9], a[8:], b, torch.zeros(2, dtype=torch.long)])
        pos = torch.cat([torch.tensor([8]), torch.arange(8, 14), torch.arange(5), torch.zeros(2, dtype=torch.long)])
        ctx = ForwardContext(
            query_start_loc=[0, 1, 7, 12],
            start_pos=[8, 8, 0],
            seq_lens=[9, 14, 5],
            context_slots=[torch.arange(9) + base["c"], torch.arange(14), torch.arange(5) + base["b"]],
            write_src=torch.arange(12),  # padding is not written
            write_slots=torch.cat([torch.tensor([8 + base["c"]]), torch.arange(8, 14), torch.arange(5) + base["b"]]),
            kv_caches=caches,
        )
        hidden = ours.forward(ids, pos, ctx)
        logits = ours.compute_logits(hidden)
    assert torch.isfinite(hidden).all()
    torch.testing.assert_close(logits[0], exp_c[8], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1:7], exp_a[8:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[7:12], exp_b, atol=ATOL, rtol=0)


def test_kv_entry_shape(pairs):
    assert pairs["llama"][0].kv_entry_shape == (2, 2, 16)
    assert pairs["qwen3"][0].kv_entry_shape == (2, 2, 32)  # explicit head_dim
    assert pairs["llama"][0].num_kv_layers == 2


def test_tied_embeddings(tmp_path, tiny_model_dirs):
    """A checkpoint without lm_head.weight and tie_word_embeddings=True (like SmolLM2)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    d = tmp_path / "tied"
    d.mkdir()
    cfg = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    state = {k: v for k, v in _state(tiny_model_dirs["llama"]).items() if k != "lm_head.weight"}
    save_file(state, str(d / "model.safetensors"))
    ours = load_model(str(d), torch.float32, torch.device("cpu")).model
    assert ours.lm_head is ours.embed_tokens
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    ids = prompt(seed=5)
    torch.testing.assert_close(SingleSequence(ours, 32).step(ids), reference_logits(ref, ids), atol=ATOL, rtol=0)
    untied = load_model(str(tiny_model_dirs["llama"]), torch.float32, torch.device("cpu")).model
    assert untied.lm_head is not untied.embed_tokens and not torch.equal(untied.lm_head, ours.lm_head)


def _state(d) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def test_load_weights_rejects_mismatches(tiny_model_dirs):
    from transformers import AutoConfig

    with torch.device("cpu"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(tiny_model_dirs["llama"]))  # unpacked, unloaded
    state = _state(tiny_model_dirs["llama"])
    ok = list(state.items()) + [("model.rotary_emb.inv_freq", torch.ones(8))]  # ignored
    model.load_weights(ok)
    missing = [(k, v) for k, v in state.items() if k != "model.norm.weight"]
    with pytest.raises(CtxparError, match="missing.*model.norm.weight"):
        model.load_weights(missing)
    with pytest.raises(CtxparError, match="unexpected.*model.extra.weight"):
        model.load_weights(list(state.items()) + [("model.extra.weight", torch.ones(2))])
    bad = dict(state)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.ones(3, 64)
    with pytest.raises(CtxparError, match=r"k_proj.weight has shape \(3, 64\)"):
        model.load_weights(bad.items())
    model.load_weights(state.items())
    model.pack_for_cpu()
    with pytest.raises(RuntimeError, match="packed"):
        model.load_weights(state.items())


def test_registry():
    assert get_model_class("LlamaForCausalLM").__name__ == "LlamaForCausalLM"
    assert get_model_class("Qwen3ForCausalLM") is get_model_class("LlamaForCausalLM")
    deepseek_v3 = ARCHITECTURES["DeepseekV3ForCausalLM"]()  # imported on first use
    assert f"{deepseek_v3.__module__}:{deepseek_v3.__name__}" == "ctxpar.models.deepseek:DeepseekV3ForCausalLM"
    assert "DeepseekV2ForCausalLM" in supported_architectures()
    with pytest.raises(CtxparError, match="unsupported model architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")

    class NoArch:
        architectures = None

    with pytest.raises(CtxparError, match="names no architecture"):
        model_class_for_config(NoArch())


def test_qwen_sliding_window_gives_its_layers_the_window(tmp_path, tiny_model_dirs):
    """Qwen's use_sliding_window windows the layers from max_window_layers on (as transformers'
    Qwen2Config; the window's arithmetic is checked in tests/models/test_sliding_window.py)."""
    d = tmp_path / "sw"
    shutil.copytree(tiny_model_dirs["qwen2"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None)
    (d / "config.json").write_text(json.dumps(cfg))
    model = load_model(str(d), torch.float32, torch.device("cpu")).model
    assert [layer.self_attn.attn.spec.window for layer in model.decoder_layers] == [None, 8]
