"""DeepSeek-V2 and DeepSeek-V3 GGUF files (``deepseek2``) as llama.cpp's own converter writes them
(helpers/llama_cpp.py) from tiny random transformers checkpoints, against transformers on the
checkpoint itself, as tests/models/test_gguf_families.py checks the dense families (its
tolerances and comparison):

- the description read from the file is the checkpoint's (MLA's dimensions, the experts, the V2 or
  V3 router, V3's yarn rope), the keys the checkpoint leaves to its class's defaults stated;
- F32: prompt logprobs on fixed token ids, argmax equal and the top token's logprob within 1e-3,
  in fp32 (the key and value up-projection the converter splits in two joined back);
- Q8_0: against transformers with the weights gguf-py dequantizes from the file (transformers'
  own GGUF loader does not read deepseek2), under the names the F32 files check; with the blocks
  kept (quantization="gguf": the experts' and attention's projections, as Qwen-MoE's) within the
  int8 activations' rounding;
- two ranks (PCP) give the bits of one; P = D = 2 its tokens, logprobs within DCP's bound.

The checkpoints' kv_lora_rank differs from the key's nope part, so a key half joined untransposed
fails; V2's has no low-rank query (V2-Lite) and two shared experts, V3's a low-rank query, expert
groups, the renormalised sigmoid router with its bias, and yarn (mscale = mscale_all_dim, as
DeepSeek's checkpoints have it). Like Qwen-MoE's, the converter needs a BPE tokenizer it knows
(tests/models/test_gguf_moe.py's ``with_bpe_tokenizer``).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from ctxpar.errors import CtxparError
from ctxpar.models.gguf_mla import SIGMOID, SOFTMAX, mla_fields
from ctxpar.models.loader import _read_config, load_model
from helpers.llama_cpp import convert
from tests.models.test_gguf_families import (
    DCP_TOL,
    QUANT_GAP,
    QUANT_TOL,
    TIE,
    TOL,
    assert_close_at_the_top,
    assert_ranks_give_the_bits_of_one,
    ctxpar_logprobs,
    peaked,
    transformers_logprobs,
)
from tests.models.test_gguf_moe import with_bpe_tokenizer

MLA = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
FAMILIES = ["v2", "v3"]


def configs() -> dict:
    from transformers import DeepseekV2Config, DeepseekV3Config

    return {
        "v2": DeepseekV2Config(**MLA, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5),
        # scoring_func and topk_method as DeepSeek-V3's config.json states them (its class has neither)
        "v3": DeepseekV3Config(
            **MLA,
            q_lora_rank=64,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            rope_parameters=dict(YARN),
        ),
    }


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """{family: (checkpoint, {outtype: GGUF file})}."""
    from helpers.deepseek_configs import save_tiny_deepseek

    root = tmp_path_factory.mktemp("gguf_deepseek")
    out = {}
    for i, (name, config) in enumerate(configs().items()):
        hf = with_bpe_tokenizer(peaked(save_tiny_deepseek(config, root / name, seed=i)))
        out[name] = (hf, {t: convert(hf, root / f"{name}-{t}.gguf", t) for t in ("f32", "q8_0")})
    return out


def test_the_files_describe_the_checkpoints(families) -> None:
    """Every key the checkpoint states is the file's; those it leaves to transformers' class
    defaults mean what the file states (V2's class routes by softmax, ungrouped, each layer)."""
    from ctxpar.models.gguf import config_from_gguf, open_gguf

    for name, (hf, files) in families.items():
        theirs = _read_config(hf, hf)
        for path in files.values():
            ours = config_from_gguf(open_gguf(path), path)
            assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)  # the file's is a float32
            stated = {f.name for f in dataclasses.fields(theirs) if getattr(theirs, f.name) is not None}
            stated -= {"rms_norm_eps", "num_nextn_predict_layers"}  # MTP layers: the converter leaves them out
            assert {k: getattr(ours, k) for k in stated} == {k: getattr(theirs, k) for k in stated}, name
            assert ours.num_nextn_predict_layers == 0 and ours.moe_layer_freq == 1
    v2 = config_from_gguf(open_gguf(families["v2"][1]["f32"]), families["v2"][1]["f32"])
    assert (v2.scoring_func, v2.n_group, v2.topk_group, v2.q_lora_rank) == ("softmax", 1, 1, None)
    v3 = _read_config(families["v3"][0], families["v3"][0])
    assert v3.model_type == "deepseek_v3" and v3.rope.rope_type == "yarn" and v3.q_lora_rank == 64


@pytest.mark.parametrize("name", FAMILIES)
def test_f32_files_match_transformers_on_the_checkpoint(families, name: str) -> None:
    hf, files = families[name]
    want = transformers_logprobs(hf)
    assert_close_at_the_top(ctxpar_logprobs(files["f32"]), want, TOL, TIE)
    assert_close_at_the_top(ctxpar_logprobs(hf), want, TOL, TIE)


@pytest.mark.parametrize("name", FAMILIES)
def test_q8_0_files_match_transformers_on_their_weights(families, name: str, tmp_path: Path) -> None:
    """Q8_0's rounding flips V3's sigmoid routing against the checkpoint's at some tokens (nats
    apart), so the reference is transformers with the file's own weights, dequantized. The blocks
    kept: V2's; the int8 activations flip V3's routing at a token of the forty as well."""
    from ctxpar.models.gguf import convert_gguf

    hf, files = families[name]
    convert_gguf(files["q8_0"], tmp_path, with_weights=True)  # gguf-py's dequantization
    shutil.copy(hf / "config.json", tmp_path / "config.json")
    want = transformers_logprobs(tmp_path)
    assert_close_at_the_top(ctxpar_logprobs(files["q8_0"]), want, TOL, TIE)
    if name == "v2":
        assert_close_at_the_top(ctxpar_logprobs(files["q8_0"], "gguf"), want, QUANT_TOL, QUANT_GAP)


def test_the_blocks_stay_in_the_projections(families) -> None:
    """quantization="gguf": the experts' and attention's projections compute on the file's blocks;
    kv_b_proj (joined from two tensors), the embeddings and the lm_head on floats."""
    from ctxpar.layers.quant_linear import QuantWeight

    model = load_model(str(families["v3"][1]["q8_0"]), torch.float32, torch.device("cpu"), quantization="gguf").model
    layer = model.model.layers[1]
    assert isinstance(layer.mlp.experts[0].down_proj.weight, QuantWeight)
    assert isinstance(layer.mlp.shared_experts.gate_proj.weight, QuantWeight)
    assert isinstance(layer.self_attn.q_b_proj.weight, QuantWeight)
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, QuantWeight)
    assert not isinstance(layer.self_attn.kv_b_proj.weight, QuantWeight)


def _meta(**keys) -> dict:
    base = {
        "rope.dimension_count": 16,
        "attention.kv_lora_rank": 64,
        "attention.key_length_mla": 48,
        "attention.value_length_mla": 32,
        "expert_count": 8,
        "expert_shared_count": 1,
        "expert_feed_forward_length": 32,
        "expert_used_count": 2,
    }
    return {f"deepseek2.{k}": v for k, v in {**base, **keys}.items()}


def test_the_router_is_read_from_the_gating_function_and_the_bias() -> None:
    """V3's files from config.json files without scoring_func have the bias and no gating function:
    V3's sigmoid router all the same. A softmax router with a bias is none of DeepSeek's: refused."""
    path, biased = Path("x.gguf"), {"blk.1.exp_probs_b.bias"}
    assert mla_fields(_meta(), biased, path)[0][0] == "deepseek_v3"
    assert mla_fields(_meta(expert_gating_func=SIGMOID), biased, path)[1]["topk_method"] == "noaux_tc"
    assert mla_fields(_meta(), set(), path)[0][0] == "deepseek_v2"
    assert mla_fields(_meta(expert_group_count=4), set(), path)[1]["topk_method"] == "group_limited_greedy"
    with pytest.raises(CtxparError, match="expert_gating_func 1 with a bias"):
        mla_fields(_meta(expert_gating_func=SOFTMAX), biased, path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, outtype", [("v2", "f32"), ("v3", "f32"), ("v2", "q8_0")])
def test_two_ranks_give_the_bits_of_one_and_dcp_its_tokens(families, name: str, outtype: str) -> None:
    """P = 2: the bits of P = 1, though each rank routes other tokens beside a token's (Q8_0: its
    blocks kept, the default for a .gguf file). P = D = 2: the same tokens, logprobs within DCP_TOL
    (tests/engine/test_same_bits.py's bound) where the projections are float; with Q8_0's blocks
    kept, within the int8 activations' bound (QUANT_TOL): DCP's merge rounds a query's attention
    apart from one rank's, and an activation that lands across a rounding step moves the next
    projection by a step of its block."""
    tol = DCP_TOL if outtype == "f32" else QUANT_TOL
    assert_ranks_give_the_bits_of_one(str(families[name][1][outtype]), tol)
