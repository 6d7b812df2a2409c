"""One request's decode steps timed through the engine, the prefill outside the clock:
what `ctxpar bench quant` reports and what `ctxpar calibrate` derives the host's cost of
a step from (ctxpar/bench/calibrate_host.py)."""

from __future__ import annotations

import time
from typing import Any


def decode_step_seconds(llm: Any, context: int, steps: int, seed: int) -> tuple[float, float]:
    """Seconds per decode step of one request after `context` tokens, and the time of
    its prefill (a fresh random prompt per seed: no prefix-cache hit)."""
    import numpy as np

    from ctxpar import SamplingParams

    engine = llm.engine
    ids = np.random.default_rng(seed).integers(0, engine.vocab_size, size=context).tolist()
    engine.add_request(ids, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while all(len(q.output_token_ids) == 0 for q in engine.requests.values()):
        engine.step()  # the prefill
    prefill = time.perf_counter() - t0
    engine.step()  # one decode step to warm up
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - t0) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, prefill
