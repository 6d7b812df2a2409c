"""A step that fails part-way leaves every request as it was.

Neighbours of a failing request (a mid-prompt chunk, a seeded sampler that
already drew, a decode) must produce exactly the tokens of a run without the
failure, at P = 1 and P = 2. (Interrupts: test_interrupts.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

import ctxpar.engine.sample.sampler as sampler_module
from ctxpar import LLM, SamplingParams
from ctxpar.worker.step_plan import StepPlan
from helpers.step_failures import CONFIG, GREEDY, SEEDED, prompt

MP = pytest.mark.multiprocess  # on the parameters that start rank processes

BAD = SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True)  # sampling it raises, below


class Boom(RuntimeError):
    pass


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=MP)], ids=["P1", "P2"])
def llm(request, tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), pcp_size=request.param, **CONFIG) as llm:
        yield llm


def drive(llm: LLM, add_bad_after: int | None = None) -> dict[str, list[int]]:
    """Run B (seeded sampling) and A (150-token prompt, chunked over 3 steps, so
    B decodes beside A's chunks) to the end; after step ``add_bad_after`` also
    add C, aborted when a step raises (as LLM.generate does). Returns A's and
    B's tokens."""
    engine = llm.engine
    ids = {"B": engine.add_request(prompt(5, 1), SEEDED), "A": engine.add_request(prompt(150, 0), GREEDY)}
    names = {v: k for k, v in ids.items()}
    out: dict[str, list[int]] = {}
    step, bad = 0, None
    while engine.has_unfinished_requests():
        if step == add_bad_after and bad is None:
            bad = engine.add_request(prompt(4, 2), BAD)
        try:
            outs = engine.step()
        except Boom:
            if bad is not None:
                engine.abort(bad)
            continue
        step += 1
        out.update({names[o.request_id]: list(o.outputs[0].token_ids) for o in outs if o.finished})
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # nothing leaked
    return out


def test_failing_sampler_leaves_the_other_requests_intact(llm, monkeypatch):
    """C's sampling raises in the step where B decodes and A ends its prompt,
    after both drew their tokens (earlier rows): A and B are unaffected."""
    want = drive(llm)
    real = sampler_module.apply_filters
    failures = []

    def apply_filters(logits, params):
        if params == BAD:  # the engine holds its own copy of the params
            failures.append(1)
            raise Boom("sampling failed")
        return real(logits, params)

    monkeypatch.setattr(sampler_module, "apply_filters", apply_filters)
    assert drive(llm, add_bad_after=1) == want
    assert failures == [1]


@pytest.mark.parametrize("when", ["before", "after"])
def test_failing_execute_leaves_the_other_requests_intact(tiny_model_dirs, when):
    """The executor raises once, before running the step or after it wrote the
    KV cache, in the step where A is mid-prompt and B decodes (P = 1: at P > 1
    a failing rank stops the ranks)."""
    with LLM(str(tiny_model_dirs["llama"]), **CONFIG) as llm:
        want = drive(llm)
        executor = llm.engine.executor
        real, calls = executor.execute, []

        def execute(plan):
            calls.append(1)
            if len(calls) == 2:
                if when == "after":
                    real(plan)
                raise Boom("step failed")
            return real(plan)

        executor.execute = execute
        assert drive(llm) == want and len(calls) > 2


def test_a_plan_row_without_tokens_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        StepPlan(
            input_ids=np.array([7], dtype=np.int64),
            num_scheduled_tokens=np.array([1, 0], dtype=np.int64),
            num_computed_tokens=np.array([0, 3], dtype=np.int64),
            is_prefilling=np.array([True, True]),
            needs_logits=np.array([True, True]),
            block_tables=[np.array([0]), np.array([1])],
        )
