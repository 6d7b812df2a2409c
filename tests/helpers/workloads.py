"""Prompts and sampling mixes that several test modules share."""

from __future__ import annotations

import numpy as np

from ctxpar import SamplingParams

SMALL = dict(kv_cache_bytes=1 << 24)  # 16 MiB of KV cache: plenty for these tests


def workload(n: int = 10, seed: int = 0, max_prompt: int = 100, max_out: int = 20):
    """Prompts of different lengths, greedy and seeded-random sampling mixed."""
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(n):
        length = int(rng.integers(1, max_prompt))
        prompts.append({"prompt_token_ids": rng.integers(0, 256, length).tolist()})
        max_tokens = int(rng.integers(4, max_out))
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        else:
            params.append(
                SamplingParams(
                    temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=max_tokens, ignore_eos=True
                )
            )
    return prompts, params


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def long_prompts(n: int, length: int = 400) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(0, 256, size=length).tolist()} for _ in range(n)]
