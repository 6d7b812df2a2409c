"""Every tensor a step makes says where it lives (CI has no GPU, so this is how the
CUDA path's placement is checked here): with torch's default device set to "meta"
inside ModelRunner.execute, a tensor made without a device would be a meta tensor,
and mixing it with the CPU's (or reading its values) fails. The PyTorch path
(CTXPAR_KERNELS=0, the one a GPU takes), for GQA and MLA + MoE models, with chunked
prefill, prefix-cache hits, prompt logprobs and a quantized KV cache."""

from __future__ import annotations

import pytest
import torch

from ctxpar import LLM, SamplingParams
from ctxpar.worker import model_runner
from helpers.deepseek_configs import tiny_deepseek_configs
from helpers.models import save_tiny_model


@pytest.fixture
def meta_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    execute = model_runner.ModelRunner.execute

    def on_meta(self, plan):
        torch.set_default_device("meta")
        try:
            return execute(self, plan)
        finally:
            torch.set_default_device(None)

    monkeypatch.setattr(model_runner.ModelRunner, "execute", on_meta)
    monkeypatch.setenv("CTXPAR_KERNELS", "0")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("model", ["llama", "qwen3", "deepseek_v3"])
def test_a_step_names_the_device_of_every_tensor(
    model, kv_cache_dtype, tiny_model_dirs, tmp_path, meta_by_default
) -> None:
    path = tiny_model_dirs.get(model) or save_tiny_model(tiny_deepseek_configs()["v3"], tmp_path / model)
    prompts = [list(range(5, 60)), [1, 2, 3], list(range(5, 40)) + [7, 8]]  # the last one hits the first's blocks
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=0)
    with LLM(str(path), device="cpu", max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype) as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
        with_logprobs = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
        llm.generate([{"prompt_token_ids": prompts[1]}], with_logprobs, use_tqdm=False)
        hit = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)[0]
    assert all(len(o.outputs[0].token_ids) == 3 for o in first)
    assert hit.num_cached_tokens == 32


def test_speculative_steps_name_their_devices_too(tiny_model_dirs, meta_by_default) -> None:
    """A draft model's steps, and the verify rows of the target's (k + 1 queries each)."""
    path = str(tiny_model_dirs["llama"])
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    with LLM(path, device="cpu", speculative_config=spec) as llm:
        out = llm.generate([{"prompt_token_ids": list(range(5, 40))}], SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 8
