"""quantization="int8": a model's projection and embedding weights quantized at load
(a float32 scale per 32 weights, q in -127..127), computed with the GGUF kernels.

- ``quantize_int8`` against float64: every weight within half a step of its
  group's scale, and each scale tight (the group's largest |w| maps to 127);
- the engine: every projection and the embedding become 8-bit QuantWeights,
  and a prefill gives the prompt logprobs of the float model whose weights are
  those blocks dequantized, within what the kernel's int8 activations move them
  (each row's activations rounded per block of 32: ``ACTIVATION_TOL``).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ctxpar import LLM, SamplingParams
from ctxpar.layers.quant_blocks import dequantize, quantize_int8
from ctxpar.layers.quant_linear import QuantWeight
from ctxpar.models.loader import INT8_WEIGHTS

# Nats a prompt logprob may move by the int8 activations (measured here: 0.04).
ACTIVATION_TOL = 0.2


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1), st.floats(1e-3, 1e3))
def test_int8_blocks_round_trip_within_half_a_step(rows, groups, seed, spread):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, 32 * groups)) * spread).astype(np.float32)
    w[0, :32] = 0  # an all-zero group
    d = quantize_int8(w)
    assert d.q.dtype == np.int8 and d.offsets is None and d.group == 32
    w64, scales = w.astype(np.float64).reshape(rows, groups, 32), d.scales.astype(np.float64)
    np.testing.assert_allclose(scales, np.abs(w64).max(axis=2) / 127, rtol=1e-6)
    back = dequantize(d).astype(np.float64).reshape(rows, groups, 32)
    assert (np.abs(back - w64) <= scales[:, :, None] / 2 * (1 + 1e-5) + 1e-30).all()
    assert (np.abs(d.q.reshape(rows, groups, 32)).max(axis=2)[scales > 0] == 127).all()
    assert not d.q[0, :32].any()


@pytest.fixture(scope="module")
def dequantized_dir(tiny_model_dirs, tmp_path_factory):
    """The tiny Llama with every int8-quantizable weight replaced by its int8 blocks, dequantized."""
    src = tiny_model_dirs["llama"]
    dst = tmp_path_factory.mktemp("int8") / "llama"
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, w in tensors.items():
            if name.endswith(INT8_WEIGHTS):
                tensors[name] = torch.from_numpy(dequantize(quantize_int8(w.float().numpy()))).to(w.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


def test_int8_engine_is_the_dequantized_model(tiny_model_dirs, dequantized_dir):
    prompt = list(np.random.default_rng(3).integers(0, 256, size=116))
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def logprobs(llm: LLM) -> np.ndarray:
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return np.array([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])])

    with LLM(str(tiny_model_dirs["llama"]), quantization="int8", dtype="float32") as llm:
        model = llm.engine.executor.rank_model.loaded.model
        kinds = {type(model.embed_tokens), type(model.layers[0].mlp.down_weight)}
        assert kinds == {QuantWeight} and model.embed_tokens.bits == 8 and model.embed_tokens.group == 32
        got = logprobs(llm)
    with LLM(str(dequantized_dir), dtype="float32") as llm:
        want = logprobs(llm)
    np.testing.assert_allclose(got, want, atol=ACTIVATION_TOL)
