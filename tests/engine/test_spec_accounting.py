"""KV and block accounting under speculative decoding, at the scheduler level.

A fake model keeps a shadow KV cache (slot -> token written there) and "samples"
a function of the tokens it read, so its greedy output is known. Requests draft
their true continuation, corrupted at a random point (so a random number of
drafts is accepted); verify rows write every draft's KV, and the rejected ones
must never be read back: not by the request itself, and not by another request
through the prefix cache. After each step the block tables hold exactly the
blocks of the verified tokens, and every block is accounted for.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.engine.block_manager import BlockManager
from ctxpar.engine.request import Request
from ctxpar.engine.scheduler import Scheduler
from ctxpar.outputs import RequestMetrics
from ctxpar.sampling_params import SamplingParams


def fake_token(tokens: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens[-6:])) + len(tokens)) % 13


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(fake_token(toks))
    return toks[len(prompt) :]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_rejected_drafts_are_never_read_and_blocks_balance(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.integers(1, 5))
    k = int(rng.integers(1, 6))
    max_len = 48
    bm = BlockManager(-(-max_len // block_size) + int(rng.integers(0, 20)), block_size, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=int(rng.integers(1, 5)), max_num_batched_tokens=int(rng.integers(k + 1, 40)))
    shared = rng.integers(0, 13, 20).tolist()  # common prompt prefixes: prefix-cache hits
    reqs: list[Request] = []
    for i in range(int(rng.integers(1, 8))):
        prompt = shared[: int(rng.integers(0, 20))] + rng.integers(0, 13, int(rng.integers(1, 10))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(1, max_len - len(prompt))), temperature=0)
        req = Request(
            f"r{i}", prompt, params, i, RequestMetrics(0.0), None, max_total_tokens=len(prompt) + params.max_tokens
        )
        reqs.append(req)
        sched.add(req)
    cache: dict[int, int] = {}  # slot -> token whose KV it holds
    for _ in range(2000):
        for req in sched.running:  # the proposer: the true continuation, wrong from a random draft on
            if req.is_decode_ready:
                truth = alone(req.prompt_token_ids + req.output_token_ids, k)
                bad = int(rng.integers(0, k + 1))
                req.spec_token_ids = truth[:bad] + [(t + 1) % 13 for t in truth[bad:]]
        batch = sched.schedule()
        if batch is None:
            break
        p = batch.plan
        qsl = np.concatenate(([0], np.cumsum(p.num_scheduled_tokens)))
        verified = []
        for i, req in enumerate(batch.requests):
            c, q = int(p.num_computed_tokens[i]), int(p.num_scheduled_tokens[i])
            table = p.block_tables[i]
            slot = lambda pos: int(table[pos // block_size] * block_size + pos % block_size)
            assert [cache[slot(pos)] for pos in range(c)] == req.token_ids(0, c)  # context intact
            ids = p.input_ids[qsl[i] : qsl[i + 1]].tolist()
            assert ids == req.token_ids(c, min(c + q, req.num_tokens)) + req.spec_token_ids
            for j, pos in enumerate(range(c, c + q)):
                cache[slot(pos)] = ids[j]  # drafts' KV written too
            if req.spec_token_ids:
                # The verifier: the fake model's token after each prefix, kept while the draft agrees.
                seq, out = req.token_ids(0, req.num_tokens), []
                for d in [*req.spec_token_ids, None]:
                    out.append(fake_token(seq + out))
                    if out[-1] != d:
                        break
                verified.append((req, out))
            elif p.needs_logits[i]:
                req.output_token_ids.append(fake_token(req.token_ids(0, c) + ids))
        sched.commit(batch)
        for req, out in verified:  # as Scheduler.update_from_output: token by token, a stop drops the rest
            for t in out:
                req.output_token_ids.append(t)
                req.num_computed_tokens = req.num_tokens - 1
                if req.num_tokens >= req.max_total_tokens:
                    break
            if req.num_tokens >= req.max_total_tokens:
                req.spec_token_ids = []
                sched.finish(req)
            else:
                sched.rollback(req)
                assert len(bm.block_table(req.request_id)) == bm.blocks_for(req.num_computed_tokens)
        for req in batch.requests:
            if not req.finished and req.num_tokens >= req.max_total_tokens:
                sched.finish(req)
        bm.check_integrity()
    assert all(r.finished for r in reqs)
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, r.params.max_tokens)
    assert bm.num_free_blocks == bm.num_blocks
