"""DeepSeek-V2/V3 (MLA + MoE) against transformers' forward pass, in fp32.

Each tiny random checkpoint is run through ctxpar as one prefill, as two
chunks (the second attending to cached context), and token by token, and the
logits are compared with one transformers forward over the whole prompt.
"""

from __future__ import annotations

import copy
import glob

import pytest
import torch
from safetensors.torch import load_file

from ctxpar.errors import CtxparError
from ctxpar.layers import mla
from ctxpar.layers.forward_context import ForwardContext
from ctxpar.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from helpers.deepseek_configs import save_tiny_deepseek, tiny_deepseek_configs
from helpers.reference import single_sequence_context

NAMES = list(tiny_deepseek_configs())
PROMPT_LEN = 20


def _load_state(path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(glob.glob(str(path / "*.safetensors"))):
        state.update(load_file(f))
    return state


@pytest.fixture(scope="module")
def ds_models(tmp_path_factory):
    """{name: (config, dir, reference logits (T, V), prompt ids (T,))}."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny_deepseek")
    out = {}
    for i, (name, cfg) in enumerate(tiny_deepseek_configs().items()):
        path = save_tiny_deepseek(cfg, root / name, seed=i)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        ids = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7 + i))
        with torch.no_grad():
            logits = ref(ids[None]).logits[0].float()
        out[name] = (cfg, path, logits, ids)
    return out


def _build(cfg, path):
    cls = DeepseekV3ForCausalLM if cfg.model_type == "deepseek_v3" else DeepseekV2ForCausalLM
    model = cls(copy.deepcopy(cfg))
    model.load_weights(_load_state(path).items())
    return model


def _run(model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Feed the prompt in chunks of the given sizes; return logits for every token."""
    caches = [torch.zeros(max(64, ids.numel()), *model.kv_entry_shape) for _ in range(model.num_kv_layers)]
    logits, start = [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)
        hidden = model.forward(ids[start : start + n], pos, single_sequence_context(caches, start, n))
        logits.append(model.compute_logits(hidden))
        start += n
    assert start == ids.numel()
    return torch.cat(logits)


SCHEDULES = {
    "prefill": [PROMPT_LEN],
    "two_chunks": [12, PROMPT_LEN - 12],
    "decode": [4] + [1] * (PROMPT_LEN - 4),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(ds_models, name, schedule):
    cfg, path, ref, ids = ds_models[name]
    model = _build(cfg, path)
    got = _run(model, ids, SCHEDULES[schedule])
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_absorbed_matches_expanded(ds_models, name, monkeypatch):
    """Latent-space attention with absorbed weights == up-projected attention,
    for decode rows, a whole prefill and a continued-prefill chunk."""
    cfg, path, _, ids = ds_models[name]
    model = _build(cfg, path)
    results = {}
    for path_name in ("absorbed", "expanded"):
        monkeypatch.setattr(mla, "ATTENTION_PATH", path_name)
        results[path_name] = _run(model, ids, [8, 6] + [1] * (PROMPT_LEN - 14))
    torch.testing.assert_close(results["absorbed"], results["expanded"], atol=1e-5, rtol=0)


def test_expanded_prefill_in_the_kernel_matches_transformers(tmp_path, monkeypatch):
    """Heads whose widths the compiled prefill kernel takes (Q/K 128, V 64): the
    expanded path hands it V unpadded, and the logits still match transformers,
    for a whole prefill and for a chunk after cached context."""
    from transformers import AutoModelForCausalLM

    from ctxpar.kernels import attention_kernels as attn_kernels

    cfg = tiny_deepseek_configs()["v2_greedy"]
    cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim = 112, 16, 64
    cfg.qk_head_dim = 128
    path = save_tiny_deepseek(cfg, tmp_path / "wide", seed=3)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    widths = []
    real = attn_kernels.prefill_attention
    monkeypatch.setattr(
        attn_kernels,
        "prefill_attention",
        lambda q, k, v, *a, **kw: widths.append((q.shape[-1], v.shape[-1])) or real(q, k, v, *a, **kw),
    )
    monkeypatch.setattr(mla, "ATTENTION_PATH", "expanded")
    model = _build(cfg, path)
    for chunks in ([150], [70, 80]):
        torch.testing.assert_close(_run(model, ids, chunks), want, atol=1e-4, rtol=1e-5)
    assert widths and set(widths) == {(128, 64)}


def test_model_interface(ds_models):
    cfg, path, _, _ = ds_models["v3"]
    model = _build(cfg, path)
    assert model.kv_entry_shape == (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
    assert model.num_kv_layers == cfg.num_hidden_layers
    assert isinstance(model.model.layers[0].mlp, torch.nn.Module)
    assert not hasattr(model.model.layers[0].mlp, "gate")  # dense first layer
    assert hasattr(model.model.layers[1].mlp, "gate")


def test_load_weights_errors(ds_models):
    cfg, path, _, _ = ds_models["v2_greedy"]
    state = _load_state(path)
    cls = DeepseekV2ForCausalLM
    missing = dict(state)
    del missing["model.layers.1.self_attn.kv_b_proj.weight"]
    with pytest.raises(CtxparError, match=r"missing 1 .*kv_b_proj"):
        cls(copy.deepcopy(cfg)).load_weights(missing.items())
    extra = dict(state)
    extra["model.layers.0.self_attn.bogus.weight"] = torch.zeros(1)
    with pytest.raises(CtxparError, match=r"unexpected 1 .*bogus"):
        cls(copy.deepcopy(cfg)).load_weights(extra.items())
    wrong = dict(state)
    wrong["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(CtxparError, match="shape"):
        cls(copy.deepcopy(cfg)).load_weights(wrong.items())


def test_fused_expert_weights_load(ds_models):
    """transformers' in-memory fused expert layout loads to the same model."""
    cfg, path, ref, ids = ds_models["v2_greedy"]
    state = _load_state(path)
    fused = {}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in state:
            continue
        E = cfg.n_routed_experts
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [
                torch.cat([state.pop(f"{p}.{e}.gate_proj.weight"), state.pop(f"{p}.{e}.up_proj.weight")])
                for e in range(E)
            ]
        )
        fused[f"{p}.down_proj"] = torch.stack([state.pop(f"{p}.{e}.down_proj.weight") for e in range(E)])
    state.update(fused)
    model = DeepseekV2ForCausalLM(copy.deepcopy(cfg))
    model.load_weights(state.items())
    torch.testing.assert_close(_run(model, ids, [PROMPT_LEN]), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", ["v2_group_yarn", "v3"])
def test_batched_rows_with_padding(ds_models, name):
    """One step with a decode row of sequence A, a prefill row of sequence B and
    a padding token that is never written: each row equals its own run."""
    cfg, path, ref, ids = ds_models[name]
    model = _build(cfg, path)
    ids_b = ids.flip(0)[:10].contiguous()
    want_b = _run(model, ids_b, [10])
    caches = [torch.zeros(64, *model.kv_entry_shape) for _ in range(model.num_kv_layers)]
    model.forward(ids[:12], torch.arange(12), single_sequence_context(caches, 0, 12))  # A's prompt in slots 0..11
    step_ids = torch.cat([ids[12:13], ids_b, torch.zeros(1, dtype=torch.long)])
    step_pos = torch.cat([torch.tensor([12]), torch.arange(10), torch.zeros(1, dtype=torch.long)])
    ctx = ForwardContext(
        query_start_loc=[0, 1, 11],
        start_pos=[12, 0],
        seq_lens=[13, 10],
        context_slots=[torch.arange(13), 32 + torch.arange(10)],
        write_src=torch.arange(11),
        write_slots=torch.cat([torch.tensor([12]), 32 + torch.arange(10)]),
        kv_caches=caches,
    )
    logits = model.compute_logits(model.forward(step_ids, step_pos, ctx))
    torch.testing.assert_close(logits[0], ref[12], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(logits[1:11], want_b, atol=1e-5, rtol=1e-5)
