"""Which steps communicate.

- A split step, or one whose unsplit rows are assigned to one rank each,
  makes one KV all-gather per attention layer, then gathers the sampled
  hidden states: to rank 0 (gloo, ranks on several hosts), or to every rank,
  which computes the logits of one range of the vocabulary, gathered to
  rank 0 (ranks on one host, through shared pages).
- A step of rows too short to split (decodes, prompts shorter than
  pcp_min_tokens): across hosts, replicated with no data collective (fewer
  than pcp_spread_min_rows of them) or assigned; on one host, led by rank 0
  with every rank's threads, then one broadcast of the new KV.

Counted on rank 0's PCPGroup, which takes part in every collective; run with
the shared-memory channel and without it (CTXPAR_SHM=0: gloo, as across hosts).
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest

from ctxpar import LLM, SamplingParams
from helpers.procs import shm_mappings

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
MIN_TOKENS = 50  # pcp_min_tokens: prefill rows shorter than this are replicated


@pytest.fixture(scope="module", params=["shm", "gloo"])
def llm(tiny_model_dirs, request):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CTXPAR_SHM", "1" if request.param == "shm" else "0")
        llm = LLM(
            str(tiny_model_dirs["llama"]),
            pcp_size=2,
            pcp_min_tokens=MIN_TOKENS,
            num_threads=1,
            kv_cache_bytes=1 << 24,
            enable_prefix_caching=False,  # every step computes its prompts in full: row sizes are what the test sends
        )
    assert (llm.engine.executor.group.shm is not None) == (request.param == "shm")
    with llm:
        yield llm


def gathering_step(llm: LLM) -> Counter:
    """The data collectives of a step that splits or assigns rows."""
    layers = llm.engine.loaded.model.num_kv_layers
    if llm.engine.executor.group.shm is None:
        return Counter(all_gather=layers, gather_to_first=1)
    return Counter(all_gather=layers + 1, gather_to_first=1)


def unsplit_step(llm: LLM, rows: int) -> Counter:
    """The data collectives of a step whose `rows` rows are all too short to split:
    on one host it is led (rank 0 alone, then one broadcast of the new KV);
    across hosts replicated (none) or, from pcp_spread_min_rows rows, assigned."""
    if llm.engine.executor.group.shm is not None:
        return Counter(broadcast=1)
    return gathering_step(llm) if rows >= spread_min_rows(llm) else Counter()


def spread_min_rows(llm: LLM) -> int:
    """pcp_spread_min_rows as the PCP policy derived it (the config leaves it None)."""
    return llm.engine.executor.runner_options.policy.spread_min_rows


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


def test_steps_without_a_split_row(llm):
    engine = llm.engine
    engine.add_request(list(range(20)), GREEDY)  # shorter than pcp_min_tokens: not split
    counts, q, prefilling = step_collectives(llm)
    assert list(q) == [20] and prefilling.all() and counts == unsplit_step(llm, 1)
    counts, q, prefilling = step_collectives(llm)  # a decode
    assert list(q) == [1] and not prefilling.any() and counts == unsplit_step(llm, 1)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_split_step_gathers_once_per_layer_then_for_sampling(llm):
    engine = llm.engine
    engine.add_request(list(range(20)), GREEDY)
    step_collectives(llm)
    engine.add_request(list(range(60)), GREEDY)  # long enough to split, beside a decode
    counts, q, prefilling = step_collectives(llm)
    assert list(q) == [1, 60] and list(prefilling) == [False, True]
    assert counts == gathering_step(llm)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_step_of_many_unsplit_rows(llm):
    """pcp_spread_min_rows (derived by the PCP policy) short prompts, then as many decodes:
    across hosts each step assigns its rows, one rank each, and gathers like a split step;
    on one host rank 0 leads them."""
    engine = llm.engine
    rows = spread_min_rows(llm)
    for i in range(rows):
        engine.add_request(list(range(i, i + 20)), GREEDY)
    for prefilling in (True, False):
        counts, q, is_prefilling = step_collectives(llm)
        assert len(q) == rows and (is_prefilling == prefilling).all() and (q < MIN_TOKENS).all()
        assert counts == unsplit_step(llm, rows)
    while engine.has_unfinished_requests():
        engine.step()


def test_led_steps_run_on_rank_0_with_the_hosts_threads(llm, monkeypatch):
    """num_threads=1 per rank: a led step runs rank 0's forward (the model's, or the
    compiled decode loop's) with both ranks' threads (2), a split step with its own
    (1); across hosts always 1."""
    import torch

    model, seen = llm.engine.loaded.model, []
    real = type(model).forward
    monkeypatch.setattr(model, "forward", lambda *a: (seen.append(torch.get_num_threads()), real(model, *a))[1])
    compiled = llm.engine.executor.runner.target.compiled
    assert compiled is not None  # a Llama in fp32: decode steps take the loop
    loop = type(compiled).forward
    monkeypatch.setattr(compiled, "forward", lambda *a: (seen.append(torch.get_num_threads()), loop(compiled, *a))[1])
    engine = llm.engine
    engine.add_request(list(range(60)), GREEDY)  # split
    step_collectives(llm)
    step_collectives(llm)  # its first decode
    led = llm.engine.executor.group.shm is not None
    assert seen == [1, 2 if led else 1] and torch.get_num_threads() == 1
    while engine.has_unfinished_requests():
        engine.step()


def test_ranks_on_one_host_read_one_copy_of_the_weights(llm):
    """Rank 0's packed weights lie in a shared file that rank 1 maps too (and that
    is already unlinked); under CTXPAR_SHM=0 each rank keeps its own."""
    from ctxpar.layers.linear import panel_weights

    weights = panel_weights(llm.engine.loaded.model)
    assert weights
    [worker] = llm.engine.executor.procs
    shared = set(shm_mappings(os.getpid())) & set(shm_mappings(worker.pid))
    ptr = weights[0].data.data_ptr()
    in_shared = any(
        line.split()[5] in shared
        and int(line.split()[0].split("-")[0], 16) <= ptr < int(line.split()[0].split("-")[1], 16)
        for line in open(f"/proc/{os.getpid()}/maps")
        if len(line.split()) >= 6
    )
    if llm.engine.executor.group.shm is None:
        assert not shared and not in_shared
    else:
        assert in_shared and len(shared) == 2  # the weights and the collectives' buffers
        assert not any(os.path.exists(path) for path in shared)  # unlinked: nothing left behind
