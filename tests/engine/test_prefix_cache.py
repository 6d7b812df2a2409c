"""Automatic prefix caching end to end: the same greedy tokens with and
without caching at P = 1, 2 and 3, multi-turn chats that hit every earlier
turn, a small cache that evicts and preempts, and a scheduler workload over
a shadow KV cache where hits must serve exactly the requester's tokens."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.engine.block_manager import BlockManager
from ctxpar.engine.request import Request
from ctxpar.engine.scheduler import Scheduler
from ctxpar.outputs import RequestMetrics

MP = pytest.mark.multiprocess  # on the parameters that start rank processes

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BS = 8  # block size of the engine tests: prompts span many blocks
TINY = dict(block_size=BS, max_model_len=256)


def shared_prefix_rounds(seed: int = 0) -> list[list[dict]]:
    """Two rounds of prompts over two shared prefixes (70 and 23 tokens):
    the first round computes them, the second asks again with new suffixes
    (0 to 40 tokens), and both rounds ask one identical 65-token prompt, whose
    repeat finds all but its last token cached (a one-token prefill)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, 70).tolist(), rng.integers(0, 256, 23).tolist()]
    rounds = []
    for _ in range(2):
        suffixes = [rng.integers(0, 256, int(n)).tolist() for n in (5, 40, 1, 17, 0, 9)]
        prompts = [docs[i % 2] + s for i, s in enumerate(suffixes)] + [docs[0][:65]]
        rounds.append([{"prompt_token_ids": p} for p in prompts])
    return rounds


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_rounds(llm: LLM, rounds: list[list[dict]]) -> tuple[list[list[int]], list[int]]:
    tokens, cached = [], []
    for prompts in rounds:
        for out in llm.generate(prompts, GREEDY, use_tqdm=False):
            tokens.append(list(out.outputs[0].token_ids))
            cached.append(out.num_cached_tokens)
    return tokens, cached


@pytest.fixture(scope="module")
def model(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    """P = 1 without prefix caching."""
    with LLM(model, enable_prefix_caching=False, **TINY) as llm:
        tokens, cached = run_rounds(llm, shared_prefix_rounds())
        assert not any(cached) and llm.engine.scheduler.prefix_cache_stats.queries == 0
    return tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pcp_size=1),
        dict(pcp_size=1, max_num_batched_tokens=24),  # chunked prefill: later rows hit earlier chunks
        pytest.param(dict(pcp_size=2, pcp_min_tokens=0), marks=MP),  # every suffix split across ranks
        pytest.param(dict(pcp_size=3, pcp_min_tokens=16), marks=MP),  # short suffixes replicated, long ones split
    ],
    ids=["P1", "P1-chunked", "P2-split", "P3"],
)
def test_same_tokens_with_and_without_caching(model, reference, kwargs):
    rounds = shared_prefix_rounds()
    with LLM(model, **TINY, **kwargs) as llm:
        tokens, cached = run_rounds(llm, rounds)
        stats = llm.engine.scheduler.prefix_cache_stats
        llm.engine.block_manager.check_integrity()
    assert tokens == reference
    first = [p["prompt_token_ids"] for p in rounds[0]]
    prompts = first + [p["prompt_token_ids"] for p in rounds[1]]
    # Round 2 finds cached every whole block it shares with round 1, short of its last token.
    for i in range(len(first), len(prompts)):
        shared = max(common_prefix(prompts[i], p) for p in first)
        assert cached[i] >= min(shared, len(prompts[i]) - 1) // BS * BS, (i, cached[i])
    assert cached[-1] == 64  # the repeated 65-token prompt computes one token
    assert all(c % BS == 0 and c < len(p) for c, p in zip(cached, prompts))
    assert stats.hits >= sum(cached) > 0 and stats.queries >= sum(map(len, prompts))


def chat(llm: LLM) -> list[tuple[int, int, list[int]]]:
    """Four turns, each resending the whole conversation plus a new user
    message; per turn: (prompt length, cached tokens, answer)."""
    rng = np.random.default_rng(1)
    conversation: list[int] = []
    turns = []
    for turn in range(4):
        conversation += rng.integers(0, 256, 11 + 6 * turn).tolist()
        [out] = llm.generate({"prompt_token_ids": conversation}, GREEDY, use_tqdm=False)
        answer = list(out.outputs[0].token_ids)
        turns.append((len(conversation), out.num_cached_tokens, answer))
        conversation += answer
    return turns


def test_multi_turn_chat_hits_every_earlier_turn(model):
    """Everything the previous turn computed (its prompt and its answer, bar
    the answer's last token, sampled but never fed back) is cached in whole
    blocks, and the answers are those of an engine without caching."""
    with LLM(model, enable_prefix_caching=False, **TINY) as llm:
        want = chat(llm)
    with LLM(model, **TINY) as llm:
        got = chat(llm)
    assert [answer for *_, answer in got] == [answer for *_, answer in want]
    assert got[0][1] == 0
    for (_, cached, _), (prev_prompt, _, prev_answer) in zip(got[1:], got[:-1]):
        assert cached == (prev_prompt + len(prev_answer) - 1) // BS * BS


def test_small_cache_evicts_and_preempts_with_the_same_tokens(model, reference):
    """A 22-block cache (176 tokens) cannot keep both prefixes of two rounds
    and all running requests: cached blocks are evicted and running requests
    preempted, recomputed with hits, and the tokens do not change."""
    with LLM(model, block_size=BS, max_model_len=160, num_kv_blocks=22, max_num_batched_tokens=64) as llm:
        tokens, cached = run_rounds(llm, shared_prefix_rounds())
        sched, bm = llm.engine.scheduler, llm.engine.block_manager
        bm.check_integrity()
        assert bm.num_free_blocks == 22
    assert tokens == reference
    assert sched.num_preemptions > 0 and bm.num_evictions > 0
    # Recomputations after preemption looked up and hit too, beyond first admissions.
    assert sched.prefix_cache_stats.hits > sum(cached) > 0


def test_aborted_request_leaves_its_computed_blocks(model, reference):
    """A request aborted mid-prefill (two 24-token chunks computed) frees its
    blocks with their KV cached; the same prompt then starts from them."""
    prompt = shared_prefix_rounds()[0][1]["prompt_token_ids"]
    with LLM(model, **TINY, max_num_batched_tokens=24) as llm:
        engine = llm.engine
        rid = engine.add_request(prompt, GREEDY)
        engine.step()
        engine.step()
        engine.abort(rid)
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        [out] = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
        engine.block_manager.check_integrity()
    assert out.num_cached_tokens == 48
    assert list(out.outputs[0].token_ids) == reference[1]


# -- scheduler over a shadow KV cache ----------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_random_shared_prefix_workload_reads_only_its_own_tokens(seed):
    """Requests built from a few shared documents arrive at random, with a
    small cache (eviction, preemption) and random token budgets. A fake model
    records, per KV slot, the (position, token) it wrote; each row's context
    must read back exactly its own known tokens, whoever wrote the slot, and
    its "sampled" token is a function of that context, so any stale or wrong
    block changes the output from the request run alone."""
    rng = np.random.default_rng(seed)
    bs = int(rng.integers(1, 5))
    max_len = 40
    bm = BlockManager(-(-max_len // bs) + int(rng.integers(0, 20)), bs)
    sched = Scheduler(bm, max_num_seqs=int(rng.integers(1, 6)), max_num_batched_tokens=int(rng.integers(1, 48)))
    docs = [rng.integers(0, 50, 30).tolist() for _ in range(3)]
    cache: dict[int, tuple[int, int]] = {}

    def fake_token(tokens: list[int]) -> int:
        return (sum((i + 1) * t for i, t in enumerate(tokens)) + len(tokens)) % 50

    reqs, expected = [], {}
    for i in range(int(rng.integers(2, 14))):
        prompt = docs[i % 3][: int(rng.integers(1, 30))] + rng.integers(0, 50, int(rng.integers(0, 5))).tolist()
        max_tokens = int(rng.integers(1, max_len - len(prompt) + 1))
        toks = list(prompt)
        for _ in range(max_tokens):
            toks.append(fake_token(toks))
        expected[f"r{i}"] = toks[len(prompt) :]
        reqs.append(
            Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0), i, RequestMetrics(0.0), None)
        )
    pending = list(reqs)
    for _ in range(5000):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        batch = sched.schedule()
        if batch is None:
            if not pending:
                break
            continue
        p = batch.plan
        qsl = np.concatenate(([0], np.cumsum(p.num_scheduled_tokens)))
        for i, req in enumerate(batch.requests):
            c, q = int(p.num_computed_tokens[i]), int(p.num_scheduled_tokens[i])
            table = p.block_tables[i]
            slot = lambda pos: int(table[pos // bs] * bs + pos % bs)
            context = [cache.get(slot(pos)) for pos in range(c)]
            assert context == list(enumerate(req.token_ids(0, c))), f"{req.request_id} read a wrong context"
            ids = p.input_ids[qsl[i] : qsl[i + 1]].tolist()
            for k, pos in enumerate(range(c, c + q)):
                cache[slot(pos)] = (pos, ids[k])
            if p.needs_logits[i]:
                req.output_token_ids.append(fake_token(req.token_ids(0, c) + ids))
        # As Engine.step: the step succeeded, so commit it, then check stops.
        sched.commit(batch)
        for req in batch.requests:
            if len(req.output_token_ids) >= req.params.max_tokens and not req.finished:
                sched.finish(req)
        bm.check_integrity()
    assert all(r.finished for r in reqs)
    assert {r.request_id: r.output_token_ids for r in reqs} == expected
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.multiprocess
def test_generate_verbose_shows_the_counters(model, tmp_path):
    import os
    import subprocess
    import sys

    from helpers.tiny_tokenizer import with_byte_tokenizer

    path = str(with_byte_tokenizer(model, tmp_path / "llama_bytes"))
    base = [
        sys.executable,
        "-m",
        "ctxpar.cli",
        "generate",
        "--model",
        path,
        "--prompt",
        "Hello there",
        "--max-tokens",
        "3",
    ]
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    for extra, want in (([], "prefix cache: 0 of "), (["--no-prefix-caching"], "prefix cache: off")):
        r = subprocess.run([*base, "-v", *extra], capture_output=True, env=env, timeout=300, encoding="utf-8")
        assert r.returncode == 0, r.stderr
        assert want in r.stderr and "time to first token" in r.stderr.strip().splitlines()[-1]


def test_bench_prefix_small_run(model, capsys):
    from ctxpar.cli import main

    assert main(["bench", "prefix", "--questions", "1"]) == 2
    assert "--questions must be >= 2" in capsys.readouterr().err
    args = ["--doc-tokens", "64", "--questions", "3", "--question-tokens", "8", "--requests", "3"]
    args += ["--shared-tokens", "32", "--own-tokens", "4", "8", "--output-len", "2", "--pcp", "1"]
    assert main(["bench", "prefix", "--model", model, *args]) == 0
    out = capsys.readouterr().out
    assert "CPU:" in out and "| 3/3" in out and "identical outputs 3/3" in out
    assert re.search(r"\|\s+64 \| 3/3", out)  # questions 2-3 found the whole document cached
