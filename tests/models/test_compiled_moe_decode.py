"""The compiled decode loop runs Qwen2-MoE's and Qwen3-MoE's experts with the forward's bits.

tests/models/test_compiled_decode.py's check for a mixture of experts: the same greedy tokens
and logprobs, as floats compared with ``==``, from ``enforce_eager=True`` (every decode step
through ``MoE.forward``, layers/moe.py) and from the compiled loop (kernels/decode_loop.cpp's
``moe``), over several decode steps of three rows of different lengths, each row routed alone.
The models: Qwen2-MoE (no renormalisation; a shared expert scaled by its sigmoid gate; a first
layer that keeps the dense MLP, so dense and expert layers alternate in the loop) and Qwen3-MoE
(renormalised top-k; q/k norms), with fp32 panel weights, int8 blocks, and a GGUF's Q8_0 blocks
kept in place. A loop that routes otherwise (no renormalisation where the model renormalises,
one expert fewer) gives other tokens or logprobs: the comparison sees routing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ctxpar.models import compiled_decode
from ctxpar.models.compiled_decode import DecoderExperts
from tests.models.test_compiled_decode import PARAMS, run
from tests.models.test_gguf_families import peaked

MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3)


def configs() -> dict:
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    from helpers.models import TINY_COMMON

    return {
        "qwen2moe": Qwen2MoeConfig(
            **{**TINY_COMMON, "num_hidden_layers": 3}, **MOE, shared_expert_intermediate_size=48, mlp_only_layers=[0]
        ),
        "qwen3moe": Qwen3MoeConfig(**TINY_COMMON, **MOE, head_dim=32, norm_topk_prob=True),
    }


@pytest.fixture(scope="module")
def moes(tmp_path_factory) -> dict[str, Path]:
    from helpers.models import save_tiny_model

    root = tmp_path_factory.mktemp("moe")
    return {name: peaked(save_tiny_model(config, root / name)) for name, config in configs().items()}


@pytest.fixture(scope="module")
def q8_0(tmp_path_factory) -> Path:
    """A Qwen3-MoE GGUF at Q8_0 written by llama.cpp's converter (tests/models/test_gguf_moe.py's)."""
    from helpers.llama_cpp import convert
    from helpers.models import save_tiny_model
    from tests.models.test_gguf_moe import configs as gguf_configs
    from tests.models.test_gguf_moe import with_bpe_tokenizer

    root = tmp_path_factory.mktemp("moe_gguf")
    hf = with_bpe_tokenizer(peaked(save_tiny_model(gguf_configs()["qwen3moe"], root / "qwen3moe")))
    return convert(hf, root / "qwen3moe-q8_0.gguf", "q8_0")


def eager_and_compiled(path: Path, monkeypatch, **kw) -> tuple[list, list]:
    kw = dict(dtype="float32", **kw)
    eager, eager_calls, _ = run(path, monkeypatch, enforce_eager=True, **kw)
    compiled, compiled_calls, built = run(path, monkeypatch, **kw)
    assert eager_calls == 0 and built
    assert compiled_calls >= PARAMS.max_tokens - 1  # every step after the prefill: decodes only
    return eager, compiled


@pytest.mark.parametrize(
    "model, quantization, kv_cache_dtype",
    [
        ("qwen2moe", None, "model"),
        ("qwen3moe", None, "model"),
        ("qwen2moe", "int8", "int8"),
    ],
)
def test_compiled_expert_steps_are_the_forward_bits(moes, monkeypatch, model, quantization, kv_cache_dtype):
    kw = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    eager, compiled = eager_and_compiled(moes[model], monkeypatch, **kw)
    assert compiled == eager


def test_a_gguf_files_experts_kept_quantized(q8_0, monkeypatch):
    eager, compiled = eager_and_compiled(q8_0, monkeypatch, quantization="gguf")
    assert compiled == eager


@pytest.mark.parametrize(
    "mutation",
    [lambda e: dataclasses.replace(e, renorm=not e.renorm), lambda e: dataclasses.replace(e, top_k=e.top_k - 1)],
    ids=["renormalisation", "top_k"],
)
def test_a_loop_that_routes_otherwise_is_seen(moes, monkeypatch, mutation):
    eager, _, _ = run(moes["qwen3moe"], monkeypatch, enforce_eager=True, dtype="float32")
    described = DecoderExperts.of
    monkeypatch.setattr(compiled_decode.DecoderExperts, "of", classmethod(lambda cls, moe: mutation(described(moe))))
    compiled, calls, built = run(moes["qwen3moe"], monkeypatch, dtype="float32")
    assert built and calls >= PARAMS.max_tokens - 1
    assert compiled != eager
