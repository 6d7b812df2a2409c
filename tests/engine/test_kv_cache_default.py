"""The KV cache's default storage (EngineConfig.kv_cache_dtype "auto", ctxpar/config.py):
int8 for a float32 model with quantized weights on the CPU (the default SmolLM2 GGUF kept),
the model's dtype otherwise; the README's table says the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.config import EngineConfig, kv_cache_dtype_for
from ctxpar.errors import CtxparError
from ctxpar.layers.kv_quant import KVQuant

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize(
    "kwargs, want",
    [
        ({}, "int8"),  # the default GGUF, its blocks kept, float32 activations
        ({"quantization": "int8"}, "int8"),
        ({"quantization": "none"}, "model"),  # float32 weights: the exact path keeps a float32 cache
        ({"dtype": "bfloat16"}, "model"),  # the quantized cache's kernels take float32 queries
        ({"kv_cache_dtype": "model"}, "model"),
        ({"kv_cache_dtype": "fp8"}, "fp8"),
        ({"quantization": "none", "kv_cache_dtype": "int8"}, "int8"),
    ],
)
def test_auto_is_resolved_once_by_the_config(kwargs, want) -> None:
    assert EngineConfig(device="cpu", **kwargs).kv_cache_dtype == want


def test_a_gpu_keeps_the_models_dtype() -> None:
    """Weights are never quantized on a GPU (EngineConfig refuses it), so "auto" keeps its cache as it was."""
    assert kv_cache_dtype_for("auto", "float32", None) == "model"
    assert kv_cache_dtype_for("auto", "bfloat16", None) == "model"


def test_the_readme_names_the_default() -> None:
    rows = [line for line in README.read_text().splitlines() if line.startswith('| `"auto"` (default)')]
    assert len(rows) == 1, rows
    assert re.search(r"\bint8\b", rows[0]) and "quantized weights" in rows[0], rows[0]


def test_the_default_engine_stores_int8_rows_and_generates() -> None:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(max_model_len=64) as llm:
        engine = llm.engine
        assert engine is not None
        model = engine.loaded.model
        want = KVQuant.of("int8", tuple(model.kv_entry_shape), tuple(model.kv_scale_runs))
        assert want is not None and engine.kv_bytes_per_token_per_layer == want.row_bytes
        out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_the_models_own_context_over_the_cache_is_bounded_by_it(tiny_model_dirs, caplog) -> None:
    """A model whose own context (512 here, Llama 3.2's 131072) needs more cache than the budget
    runs with the tokens the cache holds, saying so, where the user stated no max_model_len; a
    stated one it cannot hold is still refused (tests/parallel/test_dcp_engine.py)."""
    path = str(tiny_model_dirs["llama"])
    budget = dict(kv_cache_bytes=1 << 16, block_size=16, quantization="none")
    with caplog.at_level("WARNING", logger="ctxpar.worker.kv_cache_allocation"), LLM(path, **budget) as llm:
        engine = llm.engine
        assert engine is not None
        holds = engine.block_manager.num_blocks * 16
        assert 0 < holds < 512 and engine.max_model_len == holds
        assert "model's context of 512 tokens" in caplog.text and f"limited to {holds}" in caplog.text
        short = llm.generate([{"prompt_token_ids": list(range(1, 9))}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(short[0].outputs[0].token_ids) == 2
        with pytest.raises(ValueError, match=str(holds)):
            llm.generate([{"prompt_token_ids": [5] * holds}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(CtxparError, match="fewer than one request of max_model_len=512"):
        LLM(path, max_model_len=512, **budget)


def test_a_gguf_of_float_matrices_keeps_the_exact_path(tiny_model_dirs, tmp_path) -> None:
    """A GGUF file whose matrices are all F32 or F16 (llama.cpp's converter's f32 and f16) has
    nothing to keep as blocks: loading widens it to float32, so "auto" keeps the model's dtype,
    as for the checkpoint it came from, and its tokens are the checkpoint's, bit for bit; a
    quantized file of the same checkpoint gets the int8 cache."""
    from helpers.llama_cpp import gguf_of

    hf = tiny_model_dirs["llama"]
    files = gguf_of(hf, tmp_path, ("f32", "f16", "q8_0"))
    for outtype, weights, kv in [("f32", None, "model"), ("f16", None, "model"), ("q8_0", "gguf", "int8")]:
        config = EngineConfig(model=str(files[outtype]), device="cpu")
        assert (config.weight_quantization, config.kv_cache_dtype) == (weights, kv), outtype
    prompt = [{"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)

    def run(model: str, **kwargs) -> list:
        with LLM(model, max_model_len=64, **kwargs) as llm:
            out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        return [out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]]

    assert run(str(files["f32"])) == run(str(hf), quantization="none")
