"""Scheduler: vLLM's request priority (lower is served earlier) orders the queue and
picks who is preempted; with every priority equal, arrival order is unchanged.
The tokens a request gets never depend on it (test_server_vllm_fields.py checks
that through the server)."""

from __future__ import annotations

from ctxpar.engine.block_manager import BlockManager
from ctxpar.engine.scheduler import Scheduler
from tests.engine.test_scheduler import make_req


def admission_order(priorities: list[int]) -> list[str]:
    """Which request runs first, second, ... with one at a time."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64)
    for i, p in enumerate(priorities):
        sched.add(make_req(i, 8, max_tokens=2, priority=p))
    order = []
    while sched.has_unfinished():
        batch = sched.schedule()
        [req] = batch.requests
        if not order or order[-1] != req.request_id:
            order.append(req.request_id)
        req.output_token_ids.append(5)
        sched.commit(batch)
        if len(req.output_token_ids) >= req.params.max_tokens:
            sched.finish(req)
    return order


def test_queue_order():
    assert admission_order([0, 0, 0, 0]) == ["r0", "r1", "r2", "r3"]  # arrival order, as before
    assert admission_order([0, 5, -1, 0]) == ["r2", "r0", "r3", "r1"]  # by priority, then arrival


def test_the_highest_value_is_preempted_and_returns_in_front_of_its_priority():
    # Room for two prompts' blocks and little more: growing both needs a preemption.
    sched = Scheduler(BlockManager(5, 4), max_num_seqs=4, max_num_batched_tokens=64)
    old_low, new_high = make_req(0, 8, max_tokens=8, priority=3), make_req(1, 8, max_tokens=8, priority=0)
    later = make_req(2, 4, max_tokens=2, priority=3)
    for r in (old_low, new_high):
        sched.add(r)
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == ["r1", "r0"]  # running in priority order
    for r in batch.requests:
        r.output_token_ids.append(5)
    sched.commit(batch)
    sched.add(later)
    while old_low.num_preemptions == 0:
        batch = sched.schedule()
        assert new_high.num_preemptions == 0  # the older request, but of the higher value, goes first
        for r, need in zip(batch.requests, batch.plan.needs_logits):
            if need:
                r.output_token_ids.append(5)
        sched.commit(batch)
    assert [r.request_id for r in sched.waiting][:2] == ["r0", "r2"]  # in front of its priority
