"""prompt_logprobs at P = 1, 2, 3 equal transformers' log-softmax of the prompt.

The prompts are split over the ranks (pcp_min_tokens=4) and chunked (a small
token budget), and prefix caching is on with the same prompt sent twice: the
request must still compute, and report, every prompt position.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxpar import LLM, SamplingParams

MP = pytest.mark.multiprocess  # on the parameters that start rank processes

ENGINE = dict(kv_cache_bytes=1 << 24, max_num_batched_tokens=24, pcp_min_tokens=4, block_size=4, max_logprobs=-1)
LENGTHS = (37, 9, 2)


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    """(prompts, [log_softmax of each prompt's logits (len, V)]) from transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, n).tolist() for n in LENGTHS]
    with torch.no_grad():
        refs = [torch.log_softmax(hf(torch.tensor([p])).logits[0], -1) for p in prompts]
    return prompts, refs


def check(out, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for j in range(1, len(prompt)):
        row, d = ref[j - 1], lps[j]
        t = prompt[j]
        assert next(iter(d)) == t  # the prompt token first, then the top-k
        assert abs(d[t].logprob - row[t].item()) < 1e-4
        assert d[t].rank == 1 + int((row > row[t]).sum())
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(d) and len(d) <= k + 1
        for i in top:
            assert abs(d[i].logprob - row[i].item()) < 1e-4


@pytest.mark.parametrize("pcp_size", [1, pytest.param(2, marks=MP), pytest.param(3, marks=MP)])
def test_prompt_logprobs_equal_transformers(tiny_model_dirs, reference, pcp_size):
    prompts, refs = reference
    with LLM(str(tiny_model_dirs["llama"]), pcp_size=pcp_size, **ENGINE) as llm:
        for again in (False, True):  # the second time every full block is in the prefix cache
            plain = SamplingParams(temperature=0, max_tokens=3)
            params = [
                SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3, logprobs=1),
                plain,
                SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0),
            ]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            check(outs[0], prompts[0], refs[0], 3)
            assert outs[1].prompt_logprobs is None
            check(outs[2], prompts[2], refs[2], 0)
            if not again:  # the generated tokens are those of a request without prompt logprobs
                alone = llm.generate({"prompt_token_ids": prompts[0]}, plain, use_tqdm=False)[0]
                assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
        if pcp_size == 1:
            whole = llm.generate(
                {"prompt_token_ids": prompts[1]}, SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False
            )[0]
            check(whole, prompts[1], refs[1], 256)
            assert all(len(d) == 256 for d in whole.prompt_logprobs[1:])
