"""KeyboardInterrupt (Ctrl-C) during a step is a step failure like any other.

At P = 1 the step is rolled back and the LLM is reusable at once. At P > 1 the
other ranks are inside the step's collectives and cannot be led out of them:
rank 0 stops them, the interrupt propagates, and the next call says so, fast,
with no process left behind.
"""

from __future__ import annotations

import _thread
import multiprocessing
import signal
import time

import pytest

from ctxpar import LLM
from ctxpar.executor.multiproc import RankFailure
from helpers.step_failures import CONFIG, GREEDY, SEEDED, prompt


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Python's Ctrl-C handler, as in a terminal: a run started in the background
    by a shell without job control inherits SIGINT ignored, and then
    ``_thread.interrupt_main`` does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def interrupt_inside_the_forward(llm: LLM) -> dict[str, float]:
    """Make the next forward pass on rank 0 receive a KeyboardInterrupt between
    its first and second layer (after layer 0 gathered and wrote its KV), as a
    Ctrl-C would. Returns a dict that gets the time it was sent."""
    sent: dict[str, float] = {}

    def hook(module, args):
        handle.remove()
        sent["at"] = time.monotonic()
        _thread.interrupt_main()  # delivered at the next bytecode, inside the forward

    handle = llm.engine.loaded.model.layers[1].register_forward_pre_hook(hook)
    return sent


def test_interrupt_at_one_rank_leaves_the_llm_usable(tiny_model_dirs):
    long_prompt = {"prompt_token_ids": prompt(300, 3)}
    with LLM(str(tiny_model_dirs["llama"]), **CONFIG) as llm:
        want_long = llm.generate(long_prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        stream = llm.stream_outputs({"prompt_token_ids": prompt(5, 1)}, SEEDED)
        next(stream)  # the stream's request is in flight (decoding) during the interrupted step
        sent = interrupt_inside_the_forward(llm)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(long_prompt, GREEDY, use_tqdm=False)
        assert sent
        # The open stream goes on as if nothing happened, and the LLM works.
        last = list(stream)[-1]
        assert llm.generate(long_prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want_long
    with LLM(str(tiny_model_dirs["llama"]), **CONFIG) as fresh:
        [alone] = fresh.generate({"prompt_token_ids": prompt(5, 1)}, SEEDED, use_tqdm=False)
    assert last.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.multiprocess
def test_interrupt_at_two_ranks_stops_them_and_says_so(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), pcp_size=2, **CONFIG)
    try:
        sent = interrupt_inside_the_forward(llm)
        with pytest.raises(KeyboardInterrupt):
            llm.generate({"prompt_token_ids": prompt(300, 3)}, GREEDY, use_tqdm=False)
        assert time.monotonic() - sent["at"] < 5  # the worker was stopped, not waited for
        assert multiprocessing.active_children() == []
        start = time.monotonic()
        with pytest.raises(RankFailure, match="interrupted.*create a new LLM"):
            llm.generate({"prompt_token_ids": prompt(5, 1)}, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 5
    finally:
        llm.close()
    assert multiprocessing.active_children() == []
