"""The compiled decode loop (ctxpar/models/compiled_decode.py) computes the model's own forward.

With ``enforce_eager=True`` every decode step runs ``LlamaForCausalLM.forward``;
by default a step of decodes runs as one C++ call that makes the same kernel
calls with the same arguments. So the greedy tokens and every logprob must be
the same floats, not close ones. The runs cover fp32 panel weights and int8
block weights, a Qwen2 model (biases on the QKV projection), a Llama-3 rope,
float32, int8 and fp8 caches, a Qwen3 model (norms on the query and key heads),
Gemma 2 and Gemma 3 (sandwich norms, GELU-tanh, soft-capped and windowed attention,
Gemma 3's sliding layers' own rope; tests/models/test_gemma.py's checkpoints), and a
batch of rows of different lengths. A bfloat16 model (bf16 activations) is not the loop's:
it must decline it, and the model's forward serves (a GGUF's BF16 weights in a float32 model
are: tests/models/test_gguf_moe_bf16.py; mixtures of experts: test_compiled_moe_decode.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.models.compiled_decode import CompiledDecode
from tests.models.test_gemma import configs, peaked

PROMPTS = [list(np.random.default_rng(k).integers(0, 256, size=n)) for k, n in enumerate((5, 17, 40))]
PARAMS = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)


def run(path, monkeypatch, **kwargs) -> tuple[list, int, bool]:
    """(per prompt: token ids and logprobs, compiled steps, whether the loop was built)."""
    calls = []
    forward = CompiledDecode.forward
    monkeypatch.setattr(CompiledDecode, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    with LLM(str(path), max_model_len=128, kv_cache_bytes=1 << 22, **kwargs) as llm:
        built = llm.engine.executor.runner.target.compiled is not None
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    got = [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in outs
    ]
    monkeypatch.setattr(CompiledDecode, "forward", forward)
    return got, len(calls), built


@pytest.mark.parametrize(
    "model, quantization, kv_cache_dtype",
    [
        ("llama", None, "model"),
        ("llama", "int8", "int8"),
        ("qwen2", None, "fp8_e4m3"),
        ("llama3_rope", "int8", "model"),
        ("qwen3", None, "model"),
        ("qwen3", "int8", "int8"),
    ],
)
def test_compiled_steps_are_the_forward_bits(tiny_model_dirs, monkeypatch, model, quantization, kv_cache_dtype):
    kw = dict(dtype="float32", quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    eager, eager_calls, _ = run(tiny_model_dirs[model], monkeypatch, enforce_eager=True, **kw)
    compiled, compiled_calls, built = run(tiny_model_dirs[model], monkeypatch, **kw)
    assert eager_calls == 0 and built
    assert compiled_calls >= PARAMS.max_tokens - 1  # every step after the prefill: decodes only
    assert compiled == eager


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory) -> dict[str, Path]:
    from helpers.models import save_tiny_model

    root = tmp_path_factory.mktemp("gemma")
    return {name: peaked(save_tiny_model(config, root / name)) for name, config in configs().items()}


@pytest.mark.parametrize(
    "model, quantization, kv_cache_dtype",
    [("gemma2", None, "model"), ("gemma3", None, "model"), ("gemma3", "int8", "int8")],
)
def test_gemma_compiled_steps_are_the_forward_bits(gemmas, monkeypatch, model, quantization, kv_cache_dtype):
    test_compiled_steps_are_the_forward_bits(gemmas, monkeypatch, model, quantization, kv_cache_dtype)


def test_the_loop_declines_what_it_does_not_compute(tiny_model_dirs, monkeypatch):
    got, calls, built = run(tiny_model_dirs["llama"], monkeypatch, dtype="bfloat16")
    assert not built and calls == 0
    assert all(len(ids) == PARAMS.max_tokens for ids, _ in got)
