"""Scheduler: decodes first, token budget, chunked prefill, max_num_seqs,
preemption of the newest request, and StepPlan consistency.

The random test drives the scheduler with a fake model that keeps a shadow KV
cache (slot -> (request, position, token)): each step it checks that every
row's context is really in the cache at the slots its block table names, and
its "sampled" token is a function of the tokens it read, so a scheduling or
block bug changes the output.
"""

from __future__ import annotations

import numpy as np
import pytest

from ctxpar.engine.block_manager import BlockManager
from ctxpar.engine.request import Request, RequestStatus
from ctxpar.engine.scheduler import Scheduler
from ctxpar.outputs import RequestMetrics
from ctxpar.sampling_params import SamplingParams


def make_req(i: int, prompt_len: int, max_tokens: int = 4, priority: int = 0) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=[(i * 31 + k) % 97 for k in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens, temperature=0),
        arrival_index=i,
        metrics=RequestMetrics(arrival_time=0.0),
        generator=None,
        priority=priority,
    )


def finish_step(sched: Scheduler, batch, token: int = 5) -> list[Request]:
    """Act as the engine after a successful step: append a token to every
    sampling row, commit the step, finish at max_tokens."""
    sampled = [req for req, need in zip(batch.requests, batch.plan.needs_logits) if need]
    for req in sampled:
        req.output_token_ids.append(token)
    sched.commit(batch)
    done = [req for req in sampled if len(req.output_token_ids) >= req.params.max_tokens]
    for req in done:
        sched.finish(req)
    return done


@pytest.mark.parametrize(
    ("prompt_len", "chunks"),
    [
        (56, [16, 16, 16, 8]),  # a tail of 8: more than 16 // 8 past the budget, a step of its own
        (50, [16, 16, 18]),  # a tail of 2 (= 16 // 8) rides with the chunk before it: one step fewer
    ],
)
def test_chunked_prefill_under_budget(prompt_len, chunks):
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    req = make_req(0, prompt_len)
    sched.add(req)
    seen = []
    for _ in chunks:
        b = sched.schedule()
        p = b.plan
        seen.append((int(p.num_computed_tokens[0]), int(p.num_scheduled_tokens[0]), bool(p.needs_logits[0])))
        assert p.is_prefilling[0]
        assert list(p.input_ids) == req.prompt_token_ids[seen[-1][0] : seen[-1][0] + seen[-1][1]]
        assert len(p.block_tables[0]) * 4 >= seen[-1][0] + seen[-1][1]
        finish_step(sched, b)
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    assert seen == [(c, q, i == len(chunks) - 1) for i, (c, q) in enumerate(zip(starts, chunks))]
    b = sched.schedule()  # now a decode
    assert not b.plan.is_prefilling[0] and b.plan.num_scheduled_tokens[0] == 1 and b.plan.needs_logits[0]
    assert b.plan.num_computed_tokens[0] == prompt_len and b.plan.input_ids[0] == 5


def test_a_prompt_beside_decodes_is_not_left_a_tail():
    """A prompt as long as the budget, admitted beside running decodes (which come first),
    is computed whole in that step, its first token then, rather than all but the decodes'
    share of it now and the rest a step later; a longer one is chunked to the budget."""
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64)
    running = [make_req(i, 4, max_tokens=50) for i in range(3)]
    for r in running:
        sched.add(r)
    finish_step(sched, sched.schedule())  # the three prompts, whole: they decode from now on
    whole, long = make_req(3, 64), make_req(4, 80)
    sched.add(whole)
    sched.add(long)
    b = sched.schedule()
    assert [r.request_id for r in b.requests] == ["r0", "r1", "r2", "r3"]
    assert list(b.plan.num_scheduled_tokens) == [1, 1, 1, 64] and b.plan.needs_logits[3]
    assert b.plan.num_tokens == 67 <= 64 + 64 // 8  # the overrun is bounded; nothing more is taken
    finish_step(sched, b)
    b = sched.schedule()  # four decodes first, then the long prompt's chunk: the budget's rest
    assert list(b.plan.num_scheduled_tokens) == [1, 1, 1, 1, 60] and not b.plan.needs_logits[4]


def test_decodes_first_then_running_prefill_then_waiting():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=12)
    a, b_ = make_req(0, 3), make_req(1, 20)
    sched.add(a)
    sched.add(b_)
    batch = sched.schedule()  # a whole (3) + b's first chunk (9)
    assert [r.request_id for r in batch.requests] == ["r0", "r1"]
    assert list(batch.plan.num_scheduled_tokens) == [3, 9]
    assert list(batch.plan.needs_logits) == [True, False]
    finish_step(sched, batch)
    c = make_req(2, 5)
    sched.add(c)
    batch = sched.schedule()
    # a decodes first, then b continues with the rest of the budget; c must wait.
    assert [r.request_id for r in batch.requests] == ["r0", "r1"]
    assert list(batch.plan.num_scheduled_tokens) == [1, 11]
    assert list(batch.plan.is_prefilling) == [False, True]
    assert list(batch.plan.needs_logits) == [True, True]
    finish_step(sched, batch)
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == ["r0", "r1", "r2"]
    assert list(batch.plan.num_scheduled_tokens) == [1, 1, 5]
    assert batch.plan.num_tokens == 7


def test_max_num_seqs():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [make_req(i, 4, max_tokens=2) for i in range(5)]
    for r in reqs:
        sched.add(r)
    b = sched.schedule()
    assert [r.request_id for r in b.requests] == ["r0", "r1"] and len(sched.running) == 2
    finish_step(sched, b)
    b = sched.schedule()  # the two decode and finish; no one else fits yet
    assert [r.request_id for r in b.requests] == ["r0", "r1"]
    assert finish_step(sched, b) == reqs[:2]
    b = sched.schedule()
    assert [r.request_id for r in b.requests] == ["r2", "r3"]


def test_preempts_the_newest_and_recomputes():
    bm = BlockManager(num_blocks=3, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = make_req(0, 4, max_tokens=8), make_req(1, 4, max_tokens=8)
    sched.add(old)
    sched.add(new)
    b = sched.schedule()  # both prompts: 1 block each
    assert len(b.requests) == 2
    finish_step(sched, b)
    b = sched.schedule()  # both decode position 4: each needs a 2nd block, only one is free
    assert [r.request_id for r in b.requests] == ["r0"]
    assert b.preempted == [new]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert sched.waiting[0] is new and bm.block_table("r1") == [] and new.num_preemptions == 1
    bm.check_integrity()
    finish_step(sched, b)
    # The newcomer stays queued until blocks free up, then recomputes prompt + output.
    while not old.finished:
        b = sched.schedule()
        assert [r.request_id for r in b.requests] == ["r0"]
        finish_step(sched, b)
    b = sched.schedule()
    assert b.requests == [new]
    assert b.plan.num_computed_tokens[0] == 0 and b.plan.num_scheduled_tokens[0] == 5
    assert list(b.plan.input_ids) == new.prompt_token_ids + [5]
    assert b.plan.is_prefilling[0] and b.plan.needs_logits[0]


def test_oldest_decode_preempts_the_newest():
    bm = BlockManager(num_blocks=2, block_size=2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b_ = make_req(0, 2, max_tokens=3), make_req(1, 2, max_tokens=3)
    sched.add(a)
    sched.add(b_)
    finish_step(sched, sched.schedule())
    batch = sched.schedule()  # a preempts b (the newest) for its block
    assert batch.requests == [a] and batch.preempted == [b_]


@pytest.mark.parametrize("seed", range(40))
def test_random_workload_plans_are_consistent(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.integers(1, 6))
    max_len = int(rng.integers(8, 40))
    # The engine guarantees one request of max_len fits the cache.
    num_blocks = -(-max_len // block_size) + int(rng.integers(0, 12))
    budget = int(rng.integers(1, 48))
    max_seqs = int(rng.integers(1, 6))
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    cache: dict[int, tuple[str, int, int]] = {}  # slot -> (request, position, token)

    def fake_token(tokens: list[int]) -> int:
        return (sum((i + 1) * t for i, t in enumerate(tokens)) + len(tokens)) % 97

    reqs, expected, arrivals = [], {}, 0
    n_req = int(rng.integers(1, 12))
    for step in range(3000):
        if arrivals < n_req and rng.random() < 0.4:
            p_len = int(rng.integers(1, max_len))
            r = make_req(arrivals, p_len, max_tokens=int(rng.integers(1, max_len - p_len + 1)))
            # Expected output: the fake model run alone.
            toks = list(r.prompt_token_ids)
            for _ in range(r.params.max_tokens):
                toks.append(fake_token(toks))
            expected[r.request_id] = toks[p_len:]
            reqs.append(r)
            sched.add(r)
            arrivals += 1
        batch = sched.schedule()
        if batch is None:
            assert not sched.running and not sched.waiting
            if arrivals == n_req:
                break
            continue
        p = batch.plan
        if rng.random() < 0.2:
            # A step that fails part-way: it wrote some of its slots (with garbage), and
            # is never committed. Every request must recompute them before reading.
            for i, req in enumerate(batch.requests):
                c, q = int(p.num_computed_tokens[i]), int(p.num_scheduled_tokens[i])
                assert req.num_computed_tokens == c
                table = p.block_tables[i]
                for pos in range(c, c + int(rng.integers(0, q + 1))):
                    cache[int(table[pos // block_size] * block_size + pos % block_size)] = ("failed", pos, -1)
            bm.check_integrity()
            continue
        assert p.num_tokens <= budget + budget // 8 and p.num_rows <= max_seqs and len(sched.running) <= max_seqs
        if p.num_tokens > budget:  # only a prompt's last chunk overruns the budget
            last = int(np.flatnonzero(p.is_prefilling)[-1])
            assert p.needs_logits[last] and p.num_tokens - int(p.num_scheduled_tokens[last]) < budget
        assert len({r.request_id for r in batch.requests}) == p.num_rows
        seen_prefill = False
        qsl = np.concatenate(([0], np.cumsum(p.num_scheduled_tokens)))
        for i, req in enumerate(batch.requests):
            c, q = int(p.num_computed_tokens[i]), int(p.num_scheduled_tokens[i])
            total = req.num_tokens
            assert q >= 1 and c + q <= total and req.num_computed_tokens == c  # advanced only by commit
            decode = q == 1 and c == total - 1 and c >= req.num_prompt_tokens
            assert p.is_prefilling[i] == (not decode)
            assert not (decode and seen_prefill), "decodes come before prefills"
            seen_prefill |= not decode
            assert p.needs_logits[i] == (c + q == total)
            table = p.block_tables[i]
            assert table.dtype == np.int64 and len(table) * block_size >= c + q
            ids = p.input_ids[qsl[i] : qsl[i + 1]].tolist()
            assert ids == req.token_ids(c, c + q)
            slot = lambda pos: int(table[pos // block_size] * block_size + pos % block_size)
            context = []
            for pos in range(c):  # the context must be in the cache, intact
                owner, cpos, tok = cache[slot(pos)]
                assert (owner, cpos) == (req.request_id, pos)
                context.append(tok)
            for k, pos in enumerate(range(c, c + q)):
                cache[slot(pos)] = (req.request_id, pos, ids[k])
            if p.needs_logits[i]:
                req.output_token_ids.append(fake_token(context + ids))
        sched.commit(batch)
        for req in batch.requests:
            if len(req.output_token_ids) >= req.params.max_tokens:
                sched.finish(req)
        bm.check_integrity()
    assert arrivals == n_req and all(r.finished for r in reqs)
    for r in reqs:
        assert r.output_token_ids == expected[r.request_id]
    assert bm.num_free_blocks == num_blocks
