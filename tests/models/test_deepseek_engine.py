"""DeepSeek-V2/V3 (MLA + MoE) through the whole engine: greedy output equals
transformers' generate, and batching, chunked prefill and preemption never
change a request's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxpar import LLM, SamplingParams
from helpers.deepseek_configs import tiny_deepseek_configs
from helpers.models import save_tiny_model
from helpers.reference import transformers_greedy
from helpers.workloads import SMALL, token_ids, workload

CONFIGS = ["v2_greedy", "v2_group_yarn", "v3", "v3_yarn"]


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek_engine")
    return {name: str(save_tiny_model(cfg, root / name)) for name, cfg in tiny_deepseek_configs().items()}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_matches_transformers(deepseek_dirs, name):
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 33)]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(deepseek_dirs[name], **SMALL) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(deepseek_dirs[name], dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == transformers_greedy(hf, prompt, 32), (name, len(prompt))


@pytest.mark.parametrize("name", ["v2_group_yarn", "v3"])
def test_batched_chunked_and_preempted_equal_alone(deepseek_dirs, name):
    prompts, params = workload(n=8)
    with LLM(deepseek_dirs[name], **SMALL) as llm:
        alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == alone
    with LLM(deepseek_dirs[name], max_num_batched_tokens=16, **SMALL) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == alone
    with LLM(deepseek_dirs[name], num_kv_blocks=30, block_size=4, max_model_len=120) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == alone
        assert llm.engine.scheduler.num_preemptions > 0
