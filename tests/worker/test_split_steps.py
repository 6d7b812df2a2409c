"""Split steps whose tokens all land on one rank: a 1-token prefill chunk.

A prefill row of q < 2P tokens leaves some of its 2P chunks empty; with q = 1
only rank 0 holds a token, so the step's token count equals the padded
per-rank length n while the gathered KV entries number P*n. The KV writes must
be indexed in the gathered space, whatever the coincidence of lengths.
"""

from __future__ import annotations

import numpy as np
import pytest

from ctxpar import LLM, SamplingParams

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def workloads() -> list[tuple[int, list[dict]]]:
    """(token budget, prompts) that each schedule 1-token prefill chunks."""
    rng = np.random.default_rng(3)
    ids = lambda n: {"prompt_token_ids": rng.integers(0, 256, size=n).tolist()}
    return [
        (2048, [{"prompt_token_ids": [5]}]),  # a 1-token prompt, alone in its step
        (2, [ids(1), ids(5)]),  # two 1-token chunks, then a decode beside a 1-token chunk each step
        # the second prompt's last chunk: 1 token, beside a decode (a budget under 8 leaves its
        # prompts' tails to steps of their own: scheduler.py)
        (7, [ids(30), ids(30)]),
    ]


def run(model: str, pcp_size: int) -> list[list[list[int]]]:
    out = []
    with LLM(model, pcp_size=pcp_size, pcp_min_tokens=0, num_threads=1, kv_cache_bytes=1 << 24) as llm:
        for budget, prompts in workloads():
            # One engine for all three budgets: starting ranks is the slow part of this test.
            llm.engine.scheduler.max_num_batched_tokens = budget
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            out.append([list(o.outputs[0].token_ids) for o in outs])
    return out


@pytest.fixture(scope="module")
def one_rank(tiny_model_dirs) -> list[list[list[int]]]:
    return run(str(tiny_model_dirs["llama"]), 1)


@pytest.mark.parametrize("pcp_size", [2, 3])
def test_one_token_chunks_match_one_rank(tiny_model_dirs, one_rank, pcp_size):
    assert run(str(tiny_model_dirs["llama"]), pcp_size) == one_rank
