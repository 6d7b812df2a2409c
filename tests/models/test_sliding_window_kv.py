"""A model windowed at every layer (Mistral v0.1) gives back the KV blocks that left the window
(ctxpar/engine/kv_window.py): the same bits as with every block kept, at one rank, P = 2 and
P = D = 2, decodes that match transformers, and two long requests served at once in a KV cache
too small for both whole histories. Prompts of ~20 windows (320 tokens, a window of 16, blocks
of 16), chunked prefill, decodes past several more windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ctxpar import LLM, SamplingParams
from tests.models.test_gguf_families import COMMON, TIE, TOL, peaked
from tests.models.test_sliding_window import transformers_logprobs

WINDOW = 16
PROMPTS = [torch.randint(3, 320, (320,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
DECODES = 40
PARAMS = SamplingParams(temperature=0, max_tokens=DECODES, ignore_eos=True, logprobs=1, prompt_logprobs=1)
LAYOUT = dict(quantization="none", block_size=16, max_model_len=512, pcp_min_tokens=0, max_num_batched_tokens=64)
HISTORY_BLOCKS = -(-(len(PROMPTS[0]) + DECODES) // 16)  # 23: a whole request's


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> Path:
    from transformers import MistralConfig

    from helpers.models import save_tiny_model

    return peaked(save_tiny_model(MistralConfig(**COMMON, sliding_window=WINDOW), tmp_path_factory.mktemp("v0.1")))


def serve(
    path: Path, monkeypatch: pytest.MonkeyPatch, free: bool, prompts: list[list[int]] = PROMPTS, **kw
) -> tuple[list, dict[str, int]]:
    """The prompts through one engine: (each request's tokens, logprobs and prompt logprobs, in
    order), and what the scheduler saw: the most requests running and blocks held at once, and
    its preemptions. ``free``: whether the block manager gives back blocks the window left."""
    if not free:
        monkeypatch.setattr("ctxpar.engine.engine.freeing_window", lambda *args: None)
    seen = {"running": 0, "held": 0}
    with LLM(str(path), **{**LAYOUT, **kw}) as llm:
        engine = llm.engine
        assert engine is not None
        bm = engine.block_manager
        assert (bm.window is not None) == free
        for i, ids in enumerate(prompts):
            engine.add_request(ids, PARAMS, request_id=str(i))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            seen["running"] = max(seen["running"], len(engine.scheduler.running))
            seen["held"] = max(seen["held"], bm.num_blocks - bm.num_free_blocks)
        seen["preemptions"] = engine.scheduler.num_preemptions
    monkeypatch.undo()
    outs = [done[str(i)] for i in range(len(prompts))]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs], seen


def test_freeing_keeps_the_bits_and_matches_transformers(mistral, monkeypatch) -> None:
    """One rank, prompts chunked by 64 tokens: every token and logprob with the window's blocks
    given back == with every block kept, while each request holds about a window and an
    aligned run of keys, not its history; greedy decodes match transformers."""
    freed, seen = serve(mistral, monkeypatch, free=True, enable_prefix_caching=False)
    kept, seen_kept = serve(mistral, monkeypatch, free=False, enable_prefix_caching=False)
    assert freed == kept
    # A request holds from the aligned run its window starts in to its chunk's end: at most
    # 127 keys before the window, the window, and a chunk of 64 (with room for a scheduler that
    # lets a prompt's last chunk run an eighth over the budget).
    assert seen_kept["held"] > HISTORY_BLOCKS and seen["held"] <= 2 * -(-(127 + WINDOW + 72) // 16)
    for ids, (tokens, logprobs, _) in zip(PROMPTS, freed):
        want = transformers_logprobs(mistral, torch.tensor([*ids, *tokens]))[len(ids) - 1 : -1]  # (DECODES, vocab)
        top2 = want.topk(2, -1)
        clear = top2.values[:, 0] - top2.values[:, 1] > TIE
        assert clear.sum() >= DECODES // 2 and torch.equal(torch.tensor(tokens)[clear], top2.indices[clear, 0])
        got = torch.tensor([lp[t].logprob for lp, t in zip(logprobs, tokens)])
        assert (got - want.gather(1, torch.tensor(tokens)[:, None])[:, 0]).abs().max() < TOL


def test_two_long_requests_fit_where_their_histories_do_not(mistral, monkeypatch) -> None:
    """A cache of 31 blocks (30 and the null block) holds one request's history of 23 blocks,
    not two: keeping every block, the second waits or is preempted; giving back the window's,
    both run at once, without a preemption, and each gets the tokens it gets alone (max_num_seqs
    1: one at a time). Prefix caching on: the freed blocks stay hits while they are intact."""
    small = dict(num_kv_blocks=31, max_model_len=480, enable_prefix_caching=True)
    together, seen = serve(mistral, monkeypatch, free=True, **small)
    alone, _ = serve(mistral, monkeypatch, free=True, **small, max_num_seqs=1)
    kept, seen_kept = serve(mistral, monkeypatch, free=False, **small)
    assert together == alone == kept
    assert seen["running"] == 2 and seen["preemptions"] == 0
    assert seen_kept["running"] < 2 or seen_kept["preemptions"] > 0


def test_a_prefix_hit_after_its_first_blocks_were_evicted_keeps_the_bits(mistral) -> None:
    """A prompt asked again after another long one evicted its first blocks: the blocks a table
    starting late in it reads are still cached, so it starts there (prefix-cache hits), and
    every token and logprob is the first answer's."""
    params = SamplingParams(temperature=0, max_tokens=DECODES, ignore_eos=True, logprobs=1)
    small = dict(num_kv_blocks=31, max_model_len=480, enable_prefix_caching=True, max_num_seqs=1)
    with LLM(str(mistral), **{**LAYOUT, **small}) as llm:
        outs = [
            llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            for ids in (PROMPTS[0], PROMPTS[1], PROMPTS[0])
        ]
        engine = llm.engine
        assert engine is not None
        bm, hits = engine.block_manager, engine.scheduler.prefix_cache_stats.hits
    first, _, again = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert again == first and bm.num_evictions > 0 and hits >= 128  # from the run [128, 256) at least


@pytest.mark.multiprocess
def test_ranks_keep_the_bits_with_blocks_given_back(mistral, monkeypatch) -> None:
    """P = 2 (each rank the whole cache; DualChunkSwap pieces read from their own window) gives
    one rank's bits with every block kept; P = D = 2 (each shard's places from its window's
    run) == itself with every block kept."""
    one = dict(prompts=PROMPTS[:1], enable_prefix_caching=False)
    kept, _ = serve(mistral, monkeypatch, free=False, **one)
    two, seen = serve(mistral, monkeypatch, free=True, pcp_size=2, **one)
    assert two == kept and seen["held"] < HISTORY_BLOCKS
    dcp = dict(one, pcp_size=2, dcp_size=2)
    freed, seen = serve(mistral, monkeypatch, free=True, **dcp)
    kept, seen_kept = serve(mistral, monkeypatch, free=False, **dcp)
    assert freed == kept and seen["held"] < seen_kept["held"]


@pytest.mark.multiprocess
def test_a_lost_dcp_rank_recomputes_requests_whose_window_gave_blocks_back(mistral) -> None:
    """Under DCP a lost shard's positions are recomputed from the keys before them; where the
    window gave those back, the request recomputes all its KV instead, as a preempted one
    (engine/rank_loss.py). Rank 1 (the odd positions) is SIGKILLed as the prompt reaches 273
    tokens (chunks of 91): the step that finds it gives back positions [0, 256), which position
    259's keys at layer 1 depend on. The shard is not recomputed from the null block, the
    request is preempted, and every token and logprob is an undisturbed run's."""
    from ctxpar.config import EngineConfig
    from ctxpar.engine.engine import Engine
    from tests.executor.test_rank_recovery import kill

    def generate(kill_rank: bool) -> tuple[tuple, int]:
        layout = {**LAYOUT, "max_num_batched_tokens": 91}
        engine = Engine(EngineConfig(str(mistral), **layout, pcp_size=2, dcp_size=2))
        try:
            engine.add_request(PROMPTS[0], PARAMS, request_id="0")
            out = None
            while engine.has_unfinished_requests():
                c = engine.scheduler.running[0].num_computed_tokens if engine.scheduler.running else 0
                if kill_rank and c == 273 and engine.recovery.recoveries == 0:
                    victim = engine.executor.procs[0]
                    kill(victim.pid, 0.0)
                    victim.join(5)
                out = next((o for o in engine.step() if o.finished), out)
            assert out is not None
            rec = engine.recovery
            return (out.outputs[0].token_ids, out.outputs[0].logprobs), (
                rec.recoveries,
                rec.recomputed_tokens,
                engine.scheduler.num_preemptions,
            )
        finally:
            engine.close()

    want, _ = generate(kill_rank=False)
    got, counts = generate(kill_rank=True)
    assert counts == (1, 0, 1) and got == want
