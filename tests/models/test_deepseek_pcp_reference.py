"""DeepSeek-V2/V3 (MLA + MoE) at P = 2 and 3 against transformers directly.

Each tiny random checkpoint runs through ``LLM`` with its prompts split across
the ranks (pcp_min_tokens below every prompt chunk but the last few tokens)
and prefilled in chunks under a small token budget. The greedy tokens and
their logprobs are compared with transformers' greedy ``generate`` of the same
weights, not with P = 1, so a fault shared by every rank count cannot hide.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxpar import LLM, SamplingParams
from helpers.deepseek_configs import save_tiny_deepseek, tiny_deepseek_configs
from helpers.reference import assert_greedy_matches, transformers_greedy_logits

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

NEW_TOKENS = 16
LENGTHS = (5, 41, 97, 150)  # shorter than 2P, under the budget, 2 and 3 chunks of it
ENGINE = dict(max_num_batched_tokens=64, pcp_min_tokens=4, kv_cache_bytes=1 << 24)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
TIE = 1e-3  # fp32 logits of the two engines agree to ~1e-5 (test_deepseek.py)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def models(tmp_path_factory, prompts) -> dict[str, tuple[str, list]]:
    """{name: (checkpoint dir, transformers' (tokens, logits) per prompt)}."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("deepseek_pcp")
    out = {}
    for i, (name, cfg) in enumerate(tiny_deepseek_configs().items()):
        path = save_tiny_deepseek(cfg, root / name, seed=i)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = (str(path), [transformers_greedy_logits(hf, p, NEW_TOKENS) for p in prompts])
    return out


# V2 and V3 each at P = 2 and 3; the four configs cover both routings, q_lora on
# and off, yarn and both rope layouts (deepseek_configs.py).
CASES = [("v2_greedy", 2), ("v2_group_yarn", 3), ("v3", 3), ("v3_yarn", 2)]


@pytest.mark.parametrize("name,pcp_size", CASES)
def test_greedy_and_logprobs_match_transformers(models, prompts, name, pcp_size):
    path, reference = models[name]
    with LLM(path, pcp_size=pcp_size, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    compared = 0
    for prompt, out, (want, logits) in zip(prompts, outs, reference):
        got = out.outputs[0]
        n = assert_greedy_matches(got.token_ids, want, logits, TIE)
        compared += n
        ref = torch.log_softmax(logits, -1)
        for k in range(n):
            top2 = set(ref[k].topk(2).indices.tolist())
            assert top2 <= set(got.logprobs[k]), (len(prompt), k)
            for t, v in got.logprobs[k].items():
                assert abs(v.logprob - ref[k, t].item()) < 1e-4, (len(prompt), k, t)
    assert compared >= len(prompts) * NEW_TOKENS * 2 // 3, compared
