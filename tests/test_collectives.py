"""Which steps communicate: a step with only replicated rows (decodes, prompts
shorter than pcp_min_tokens, fewer than pcp_spread_min_rows of them) makes no
data collective; a split step, or one whose unsplit rows are assigned to one
rank each, makes one KV all-gather per attention layer and one gather of the
sampled hidden states.

Counted on rank 0's PCPGroup, which takes part in every collective.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from ctxpar import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
MIN_TOKENS = 50  # pcp_min_tokens: prefill rows shorter than this are replicated


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    with LLM(
        str(tiny_model_dirs["llama"]), pcp_size=2, pcp_min_tokens=MIN_TOKENS, num_threads=1, kv_cache_bytes=1 << 24,
        enable_prefix_caching=False,  # every step computes its prompts in full: row sizes are what the test sends
    ) as llm:
        yield llm


def step_collectives(llm: LLM) -> tuple[Counter, np.ndarray, np.ndarray]:
    """Run one engine step; its data collectives and its rows' (q, is_prefilling)."""
    engine, group = llm.engine, llm.engine.executor.group
    executor, plans = engine.executor, []
    real = type(executor).execute

    def execute(plan):
        plans.append(plan)
        return real(executor, plan)

    before = Counter(group.num_collectives)
    executor.execute = execute
    try:
        engine.step()
    finally:
        del executor.execute
    [plan] = plans
    return group.num_collectives - before, plan.num_scheduled_tokens, plan.is_prefilling


def test_replicated_steps_make_no_data_collective(llm):
    engine = llm.engine
    engine.add_request(list(range(20)), GREEDY)  # shorter than pcp_min_tokens: replicated
    counts, q, prefilling = step_collectives(llm)
    assert list(q) == [20] and prefilling.all() and counts == Counter()
    counts, q, prefilling = step_collectives(llm)  # a decode
    assert list(q) == [1] and not prefilling.any() and counts == Counter()
    while engine.has_unfinished_requests():
        engine.step()


def test_a_split_step_gathers_once_per_layer_and_once_for_sampling(llm):
    engine = llm.engine
    layers = engine.loaded.model.num_kv_layers
    engine.add_request(list(range(20)), GREEDY)
    step_collectives(llm)
    engine.add_request(list(range(60)), GREEDY)  # long enough to split, beside a decode
    counts, q, prefilling = step_collectives(llm)
    assert list(q) == [1, 60] and list(prefilling) == [False, True]
    assert counts == Counter(all_gather=layers, gather_to_first=1)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_step_of_enough_decodes_spreads_them(llm):
    """pcp_spread_min_rows (default) short prompts, then as many decodes: each step assigns
    its rows, one rank each, so it gathers like a split step."""
    engine = llm.engine
    layers, rows = engine.loaded.model.num_kv_layers, llm.engine.config.pcp_spread_min_rows
    for i in range(rows):
        engine.add_request(list(range(i, i + 20)), GREEDY)
    for prefilling in (True, False):
        counts, q, is_prefilling = step_collectives(llm)
        assert len(q) == rows and (is_prefilling == prefilling).all() and (q < MIN_TOKENS).all()
        assert counts == Counter(all_gather=layers, gather_to_first=1)
    while engine.has_unfinished_requests():
        engine.step()
