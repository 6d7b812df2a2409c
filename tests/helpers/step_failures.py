"""The engine settings and requests of the step-failure tests (engine/test_step_failures.py),
shared with the interrupt tests (engine/test_interrupts.py)."""

from __future__ import annotations

import numpy as np

from ctxpar import SamplingParams

# Prefix caching off: each drive() (test_step_failures.py) must replay the same steps (A's prompt in
# three chunks), which a cache hit on the second drive would shorten.
CONFIG = dict(
    max_num_batched_tokens=64, pcp_min_tokens=0, num_threads=1, kv_cache_bytes=1 << 24, enable_prefix_caching=False
)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()
