"""A rank SIGKILLed with requests in flight is respawned and its KV restored:
every request finishes with exactly the tokens of an undisturbed run (greedy
and seeded sampling), at P = 2 and 3, with and without DCP; beyond
max_rank_recoveries the engine stops as without recovery. Without DCP, in the
default configuration (SmolLM2's GGUF, its blocks kept quantized), the
undisturbed run is each request generated alone, offline: the recomputed KV
(other steps, other company) gives the same bits.

Kills land at points drawn from a seeded RNG: between steps (found by the
check at the next step's start), or from a timer inside a step (a collective
fails under the survivors: a KV all-gather, a plan broadcast, a gather of
hidden states). Under DCP the lost rank's shard is recomputed from the
tokens; a mutant that skips it (or that keeps serving prefix-cache blocks the
lost rank held part of) gives other tokens.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar import LLM, SamplingParams
from ctxpar.config import EngineConfig
from ctxpar.engine.engine import Engine
from ctxpar.engine.rank_recovery import RankRecovery, lost_runs, recompute_plans
from ctxpar.errors import RankFailure

# Long prompts are chunked (budget 96) and split (>= 48 tokens); short ones replicated.
LENGTHS = (260, 17, 150, 5, 90)
CONFIG = dict(max_num_batched_tokens=96, pcp_min_tokens=48, num_kv_blocks=96, max_model_len=512)


def params(i: int) -> SamplingParams:
    if i % 2:  # seeded sampling: the generator's state must survive the failed step too
        return SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
    return SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, size=n).tolist() for n in LENGTHS]


def run(
    model: str,
    kills: dict[int, tuple[int, float]] | None = None,
    repeat_first: bool = False,
    started: Callable[[], None] = lambda: None,
    **kw,
) -> tuple:
    """Every prompt's tokens, and the engine's recovery counts. kills: {step: (rank, delay)}:
    before that step, SIGKILL the rank after `delay` seconds (0: before the step starts).
    repeat_first: the first prompt, finished before any kill, is asked again after the last
    kill (a prefix-cache hit on blocks no request held when the rank was lost).
    started: called once the ranks are up."""
    engine = Engine(EngineConfig(model, **CONFIG, **kw))
    started()
    kills = kills or {}
    out: dict[str, list[int]] = {}
    try:
        ps = prompts()
        engine.add_request(ps[0], params(0), request_id="first")
        while "first" not in out:
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        for i, p in enumerate(ps[1:], start=1):
            engine.add_request(p, params(i), request_id=str(i))
        step = 0
        while engine.has_unfinished_requests():
            victim = None
            if step in kills:
                rank, delay = kills[step]
                victim = engine.executor.procs[rank - 1]
                timer = kill(victim.pid, delay)
            if repeat_first and step == max(kills, default=0) + 1:
                engine.add_request(ps[0], params(0), request_id="again")
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            if victim is not None:  # dead now, if not found in this step then at the next one's start
                timer.join()
                victim.join(5)
            step += 1
        return out, engine.recovery
    finally:
        engine.close()


def kill(pid: int, delay: float) -> threading.Timer:
    """SIGKILL pid after delay seconds (0: now, and dead before the next step starts)."""
    timer = threading.Timer(delay, os.kill, (pid, signal.SIGKILL))
    timer.start()
    if delay == 0:
        timer.join()
        time.sleep(0.2)  # its exit is seen by the check at the step's start
    return timer


@pytest.fixture(scope="module")
def model(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def undisturbed(model) -> dict[str, list[int]]:
    out, _ = run(model, repeat_first=True)
    assert out["again"] == out["first"]
    return out


@pytest.fixture(scope="module")
def alone() -> dict[str, list[int]]:
    """Each prompt generated alone, offline, by the default model as the engine runs it."""
    with LLM(**CONFIG) as llm:
        out = {
            ("first" if i == 0 else str(i)): llm.generate([{"prompt_token_ids": p}], params(i), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
            for i, p in enumerate(prompts())
        }
    return {**out, "again": out["first"]}


def random_kills(seed: int, ranks: list[int], n: int) -> dict[int, tuple[int, float]]:
    """n kills at early steps (prefill chunks, split prompts, decodes): before a step, or
    1-30 ms into it. Two steps apart: a rank killed after its step's collectives is
    recovered at the next step's start, and the next kill is meant for its successor."""
    rng = np.random.default_rng(seed)
    steps = sorted(rng.choice(np.arange(1, 10, 2), size=n, replace=False).tolist())
    return {s: (int(rng.choice(ranks)), float(rng.choice([0.0, rng.uniform(0.001, 0.03)]))) for s in steps}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("pcp", "dcp", "seed"),
    [(2, 1, 0), (2, 2, 1), (3, 3, 2)],
    ids=["p2-full-kv", "p2-dcp", "p3-dcp"],
)
def test_lost_ranks_are_recovered_with_the_same_tokens(request, model, pcp, dcp, seed):
    kills = random_kills(seed, list(range(1, pcp)), n=2)
    # DCP merges a query's shards in another order than one rank: its recovered runs are
    # compared with an undisturbed one-rank run on the fp32 tiny model (tokens); the rest
    # with each request alone in the default configuration.
    want, on = (request.getfixturevalue("undisturbed"), model) if dcp > 1 else (request.getfixturevalue("alone"), None)
    out, rec = run(on, kills, repeat_first=True, pcp_size=pcp, dcp_size=dcp)
    assert out == want, kills
    assert rec.rank_failures == rec.recoveries == 2
    if dcp > 1:  # the lost shard, not the whole context: about 1/D of the computed tokens
        assert rec.recomputed_tokens > 0 and rec.copied_tokens == 0
    else:
        assert rec.copied_tokens > 0 and rec.recomputed_tokens == 0
    assert multiprocessing.active_children() == []


def test_failures_beyond_the_limit_stop_the_engine(model):
    engine = Engine(EngineConfig(model, pcp_size=2, max_rank_recoveries=1, **CONFIG))
    try:
        engine.add_request(prompts()[0], params(0))
        kill(engine.executor.procs[0].pid, 0)
        engine.step()
        assert engine.recovery.recoveries == 1
        kill(engine.executor.procs[0].pid, 0)
        with pytest.raises(RankFailure, match=r"rank 1 was killed by SIGKILL.*not recovered.*max_rank_recoveries"):
            engine.step()
        with pytest.raises(RankFailure, match="create a new LLM"):
            engine.step()  # stopped for good
        assert multiprocessing.active_children() == []
    finally:
        engine.close()


@pytest.mark.multiprocess
def test_a_rank_that_cannot_come_back_is_left_out(model, undisturbed, tmp_path):
    """The model's files vanish once the ranks are up, so a respawned rank fails to load
    it: without DCP the engine goes on with the survivors (every one holds the whole
    cache), P = 3 -> 2 -> 1, and the requests finish with the undisturbed tokens."""
    copy = shutil.copytree(model, tmp_path / "model")
    gone = lambda: copy.rename(tmp_path / "moved")  # noqa: E731
    out, rec = run(str(copy), {1: (1, 0.0), 4: (1, 0.01)}, repeat_first=True, started=gone, pcp_size=3)
    assert out == undisturbed
    assert rec.rank_failures == rec.recoveries == 2 and rec.pcp_ranks == 1
    assert rec.copied_tokens == rec.recomputed_tokens == 0  # nothing to restore
    assert multiprocessing.active_children() == []


@pytest.mark.multiprocess
def test_under_dcp_the_ranks_left_reshard_and_recompute(model, tmp_path):
    """P = D = 3 and rank 1 lost for good: its shard of every request is gone and two
    ranks cannot take over a layout by position modulo 3, so the cache is rebuilt for
    D = 2 (two thirds of the tokens) and the requests in flight recompute their KV:
    they finish with one rank's tokens, and the one whose context no longer fits the
    smaller cache fails alone."""
    copy = shutil.copytree(model, tmp_path / "model")
    ps = prompts()
    jobs = {
        "too long now": (ps[0][:100], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)),
        "greedy": (ps[2], params(0)),
        "seeded": (ps[4], params(1)),
    }

    def generate(engine: Engine, kill_at: int | None = None) -> dict:
        for rid, (p, sp) in jobs.items():
            engine.add_request(p, sp, request_id=rid)
        out, step = {}, 0
        while engine.has_unfinished_requests():
            if step == kill_at:
                kill(engine.executor.procs[0].pid, 0)
            out.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
            step += 1
        return out

    engine = Engine(EngineConfig(model, **CONFIG))
    try:
        want = generate(engine)
    finally:
        engine.close()
    # 8 blocks of 16 tokens on each of 3 ranks: 384 tokens, then 256 on 2.
    engine = Engine(EngineConfig(str(copy), pcp_size=3, dcp_size=3, **dict(CONFIG, num_kv_blocks=8, max_model_len=384)))
    try:
        copy.rename(tmp_path / "moved")  # a respawned rank cannot load the model
        got = generate(engine, kill_at=2)
        assert engine.recovery.pcp_ranks == 2 and engine.dcp_size == 2 and engine.max_model_len == 256
    finally:
        engine.close()
    assert got["too long now"].finish_reason == "abort"
    assert {k: got[k].token_ids for k in ("greedy", "seeded")} == {k: want[k].token_ids for k in ("greedy", "seeded")}
    assert multiprocessing.active_children() == []


# -- the pure parts -------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(2, 4), st.integers(1, 4), st.data())
def test_lost_runs_are_exactly_the_lost_ranks_positions(n, size, interleave, data):
    lost = data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=size - 1, unique=True))
    starts, lengths = lost_runs(n, lost, size, interleave)
    covered = [p for s, m in zip(starts.tolist(), lengths.tolist()) for p in range(s, s + m)]
    assert covered == [p for p in range(n) if (p // interleave) % size in lost]  # in order, once each
    assert (lengths > 0).all() and (np.diff(starts) > lengths[:-1]).all()  # maximal runs


class _Req:
    def __init__(self, tokens: list[int], computed: int, prompt: int) -> None:
        self.tokens, self.num_computed_tokens, self.num_prompt_tokens = tokens, computed, prompt

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def test_recompute_plans_cover_the_runs_in_order_within_the_budget():
    reqs = [_Req(list(range(100, 140)), 37, 30), _Req(list(range(200, 210)), 10, 10)]
    table = {id(r): np.array([i]) for i, r in enumerate(reqs)}  # block table [i]: tells the rows apart
    plans = list(recompute_plans(reqs, lambda r: table[id(r)], [1], 2, 2, max_tokens=5))  # type: ignore[arg-type]
    assert all(p.num_tokens <= 5 and not p.needs_logits.any() and p.is_prefilling.all() for p in plans)
    # Each row's prompt length rides along: its generated tokens attend as decodes did.
    assert all(p.num_prompt_tokens is not None and set(p.num_prompt_tokens.tolist()) <= {30, 10} for p in plans)
    rows = [
        (int(t[0]), int(c), p.input_ids[o : o + q].tolist())
        for p in plans
        for t, c, q, o in zip(
            p.block_tables,
            p.num_computed_tokens,
            p.num_scheduled_tokens,
            np.cumsum(p.num_scheduled_tokens) - p.num_scheduled_tokens,
        )
    ]
    for i, req in enumerate(reqs):
        mine = [(c, ids) for t, c, ids in rows if t == i]
        positions = [c + i for c, ids in mine for i in range(len(ids))]
        assert positions == [p for p in range(req.num_computed_tokens) if (p // 2) % 2 == 1]
        assert all(ids == req.tokens[c : c + len(ids)] for c, ids in mine)


def test_the_recovery_window():
    rec = RankRecovery(max_recoveries=2, window_s=10.0)
    assert rec.allow(0.0) and rec.allow(5.0) and not rec.allow(9.0)
    assert rec.allow(10.5)  # the first one left the window
    assert not RankRecovery(max_recoveries=0, window_s=10.0).allow(0.0)
