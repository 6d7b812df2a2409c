"""Gemma 2 and Gemma 3 (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``) from Hugging Face directories
against transformers on the same tiny random checkpoints (fp32 prompt logprobs: argmax equal, the
top token's logprob within 1e-3), with every Gemma feature biting: a window of 16 keys under a
40-token prompt (2.5 windows), Gemma 2's soft-caps set low enough to cap (attention 5, logits
30), query_pre_attn_scalar unlike head_dim, head_dim unlike hidden / heads, Gemma 3's q/k norms,
its sliding layers' rope beside the global layers' linear-scaled one; the prompt prefilled whole
and decoded a token at a time (the paged cache's window). P = 2 gives one rank's bits, P = D = 2
its tokens (tests/models/test_gguf_families.py's check). GELU-tanh gives an element the same bits
whatever the call's length.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ctxpar.layers.activation import gelu_tanh_and_mul
from ctxpar.model_args import RopeScaling
from ctxpar.models.loader import _read_config, load_model
from helpers.reference import SingleSequence
from tests.models.test_gguf_families import (
    IDS,
    TIE,
    TOL,
    assert_close_at_the_top,
    assert_ranks_give_the_bits_of_one,
    ctxpar_logprobs,
    transformers_logprobs,
)

WINDOW = 16
GEMMA = dict(
    vocab_size=320,  # the test tokenizer's pieces (IDS)
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # not hidden / heads
    max_position_embeddings=512,
    sliding_window=WINDOW,
    tie_word_embeddings=True,  # as Gemma's checkpoints (and a gemma2 GGUF, whose converter drops lm_head)
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LINEAR = {"rope_type": "linear", "factor": 8.0}  # Gemma 3 4B-27B's global layers


def configs() -> dict:
    from transformers import Gemma2Config, Gemma3TextConfig

    return {
        "gemma2": Gemma2Config(
            **GEMMA,
            num_hidden_layers=4,  # sliding, full, sliding, full
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            architectures=["Gemma2ForCausalLM"],
        ),
        "gemma3": Gemma3TextConfig(
            **GEMMA,
            num_hidden_layers=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_scaling=LINEAR,
            architectures=["Gemma3ForCausalLM"],
        ),
    }


def peaked(hf_dir: Path, factor: float = 16.0) -> Path:
    """tests/models/test_gguf_families.py's ``peaked`` for tied embeddings: the final norm's factor
    (1 + w) times ``factor``, logits spread over several nats. (The table times ``factor`` would
    make every position's top token its own input token, the embedding's dot product with itself,
    whatever the attention computes: the argmax comparisons would check nothing.)"""
    from safetensors.torch import load_file, save_file

    weights = load_file(hf_dir / "model.safetensors")
    weights["model.norm.weight"] = (1 + weights["model.norm.weight"]) * factor - 1
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    return hf_dir


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory) -> dict[str, Path]:
    from helpers.models import save_tiny_model

    root = tmp_path_factory.mktemp("gemma")
    return {name: peaked(save_tiny_model(config, root / name)) for name, config in configs().items()}


def test_the_description_is_the_configs(gemmas) -> None:
    two, three = (_read_config(gemmas[n], gemmas[n]) for n in ("gemma2", "gemma3"))
    assert two.layer_types == ("sliding_attention", "full_attention") * 2 and two.sliding_window == WINDOW
    assert (two.query_pre_attn_scalar, two.attn_logit_softcapping, two.final_logit_softcapping) == (24, 5.0, 30.0)
    assert two.hidden_act == "gelu_pytorch_tanh" and two.sliding_rope is None and not two.qk_norm
    assert three.sliding_layers == [0, 1, 3] and three.qk_norm and three.final_logit_softcapping is None
    assert three.rope == RopeScaling(rope_type="linear", rope_theta=1e6, factor=8.0)
    assert three.sliding_rope == RopeScaling(rope_theta=10000.0)
    assert _read_config(gemmas["gemma3"], gemmas["gemma3"]).to_config_json()["rope_parameters"] == {
        "full_attention": three.rope.parameters,
        "sliding_attention": three.sliding_rope.parameters,
    }


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_prefill_and_decode_match_transformers(gemmas, name: str) -> None:
    want = transformers_logprobs(gemmas[name])
    assert_close_at_the_top(ctxpar_logprobs(gemmas[name]), want, TOL, TIE)
    model = load_model(str(gemmas[name]), torch.float32, torch.device("cpu")).model
    seq = SingleSequence(model, 64)
    first = 2 * WINDOW - 3  # then a token at a time: each decode's window over the paged cache
    steps = [seq.step(IDS[:first])] + [seq.step(IDS[i : i + 1]) for i in range(first, len(IDS))]
    assert_close_at_the_top(torch.log_softmax(torch.cat(steps), -1), want, TOL, TIE)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_two_ranks_give_the_bits_of_one_and_dcp_its_tokens(gemmas, name: str) -> None:
    assert_ranks_give_the_bits_of_one(str(gemmas[name]))


def test_the_models_features_are_exercised(gemmas) -> None:
    """The checkpoints are ones where a Gemma feature left out changes the result: transformers
    with the window, a soft-cap or Gemma 3's sliding layers' own rope turned off gives logprobs
    more than 100 times the tolerance away."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def logprobs(name: str, **changes) -> torch.Tensor:
        config = AutoConfig.from_pretrained(gemmas[name])
        for key, value in changes.items():
            setattr(config, key, value)
        ref = AutoModelForCausalLM.from_pretrained(gemmas[name], config=config, attn_implementation="eager")
        with torch.no_grad():
            return torch.log_softmax(ref.eval()(IDS[None]).logits[0].float(), -1)

    off = {"sliding_window": len(IDS), "attn_logit_softcapping": None, "final_logit_softcapping": None}
    want = transformers_logprobs(gemmas["gemma2"])
    for key, value in off.items():
        assert (logprobs("gemma2", **{key: value}) - want).abs().max() > 100 * TOL, key
    one_rope = {kind: {"rope_type": "default", "rope_theta": 1e6} for kind in ("full_attention", "sliding_attention")}
    one_rope["full_attention"] = {**LINEAR, "rope_theta": 1e6}
    changed = logprobs("gemma3", rope_parameters=one_rope)
    assert (changed - transformers_logprobs(gemmas["gemma3"])).abs().max() > 100 * TOL


def test_gelu_tanh_gives_each_element_its_own_bits() -> None:
    """A row's gelu_tanh(gate) * up whatever rows and elements share the call (F.gelu's tanh
    form rounds its vectorized loop and its scalar tail apart), float32's within its rounding, bfloat16's
    rounded once from it (a bf16 ulp or two from F.gelu's, which underflows to 0 where this is ~1e-7)."""
    gate_up = torch.randn(37, 2 * 1000, generator=torch.Generator().manual_seed(0)) * 3
    whole = gelu_tanh_and_mul(gate_up)
    for rows in ((0, 1), (5, 6), (3, 20), (36, 37)):  # F.gelu's rows 3-19 alone differ from the whole's
        assert torch.equal(gelu_tanh_and_mul(gate_up[rows[0] : rows[1]]), whole[rows[0] : rows[1]])
    gate, up = gate_up.double().chunk(2, -1)
    assert (whole.double() - F.gelu(gate, approximate="tanh") * up).abs().max() < 1e-5
    low = gelu_tanh_and_mul(gate_up.bfloat16())  # rounded once from float32, as F.gelu's bf16
    gate, up = gate_up.bfloat16().chunk(2, -1)
    ref = (F.gelu(gate, approximate="tanh") * up).float()
    assert low.dtype == torch.bfloat16 and ((low.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-5).all()
