"""The engine under decode context parallelism (P = D = 2): a per-rank KV
budget too small for a request at D = 1 holds it at D = 2, and the tokens
equal one rank's with a large cache, through chunked prefill, preemption
(logical blocks counted) and prefix-cache hits (logical blocks hashed)."""

from __future__ import annotations

import numpy as np
import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.cli import main
from ctxpar.entrypoints.cli.generate import _describe
from ctxpar.errors import CtxparError

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BLOCK = 8
# Tiny llama: K and V of 2 heads x 16 dims in fp32, 2 layers = 512 bytes per token per rank.
BYTES_PER_TOKEN = 2 * 2 * 16 * 4 * 2
BUDGET = 24 * BLOCK * BYTES_PER_TOKEN  # per rank: 24 blocks = 192 tokens at D = 1, 384 at D = 2
LONG = 280  # a prompt that fits only when sharded
ENGINE = dict(block_size=BLOCK, kv_cache_bytes=BUDGET, max_model_len=LONG + 16, max_num_batched_tokens=64)


def prompts() -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"prompt_token_ids": rng.integers(0, 256, size=n).tolist()} for n in (LONG, 3, 90, 40, 130)]


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_budget_too_small_unsharded_is_refused(tiny_model_dirs):
    with pytest.raises(CtxparError, match=r"holds 24 blocks \(192 tokens\), fewer than one request"):
        LLM(str(tiny_model_dirs["llama"]), pcp_size=2, **ENGINE)


@pytest.mark.multiprocess
def test_sharded_cache_holds_it_and_matches_one_rank(tiny_model_dirs, capsys):
    model = str(tiny_model_dirs["llama"])
    with LLM(model, enable_prefix_caching=False) as llm:  # large (default) cache, one rank
        want = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    with LLM(model, pcp_size=2, dcp_size=2, pcp_min_tokens=50, **ENGINE) as llm:
        engine = llm.engine
        assert engine.num_blocks == 24 and engine.block_manager.block_size == 2 * BLOCK
        _describe(llm, 0.0)  # what `ctxpar generate --verbose` prints first
        shown = capsys.readouterr().err
        assert f"{BYTES_PER_TOKEN // 2:g} bytes per token per rank" in shown and "384 tokens in all" in shown
        assert "P=2, D=2): pcp_min_tokens=50 (set), pcp_spread_min_rows=never (DCP" in shown
        pids = engine.executor.rank_pids()  # each rank's memory, read from its own process
        assert len(set(pids)) == 2 and all(f"rank {r}: resident " in shown for r in range(2))
        assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == want
        # The long request alone takes 19 of the 24 logical blocks: the others were preempted.
        assert engine.scheduler.num_preemptions > 0
        # Again: the prompts' full logical blocks come from the prefix cache.
        hits = engine.scheduler.prefix_cache_stats.hits
        assert tokens(llm.generate(prompts()[1:], GREEDY, use_tqdm=False)) == want[1:]
        assert engine.scheduler.prefix_cache_stats.hits > hits


@pytest.mark.parametrize(
    "args, words",
    [
        (["--pcp", "2", "--dcp", "3"], ["dcp_size=3", "pcp_size=2", "dcp_size=2"]),
        (["--dcp", "2"], ["dcp_size=2", "pcp_size=1", "pcp_size=2"]),
        (
            ["--pcp", "2", "--dcp", "2", "--cp-interleave", "3"],
            ["cp_interleave=3", "block_size=16", "[1, 2, 4, 8, 16]"],
        ),
        (["--cp-interleave", "0"], ["cp_interleave", "[1, 16]"]),
    ],
)
def test_bad_dcp_flags_exit_2_before_any_rank_starts(args, words, capsys):
    assert main(["generate", *args]) == 2  # refused by EngineConfig: no model is even loaded
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for w in words:
        assert w in err


def test_serve_takes_the_dcp_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--dcp D" in out and "--cp-interleave I" in out
