"""The engine with P context-parallel ranks: the same tokens as one rank and as
transformers, arrivals at different steps, preemption, failure and cleanup."""

from __future__ import annotations

import gc
import multiprocessing
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError
from ctxpar.executor.multiproc import RankFailure, free_port
from helpers.deepseek_configs import tiny_deepseek_configs
from helpers.models import save_tiny_model
from helpers.pcp_harness import run_plans, scripted_plans
from helpers.reference import transformers_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n: int = 9, seed: int = 0) -> list[dict]:
    """Mixed lengths: shorter than 2P, around the chunk budget, long."""
    rng = np.random.default_rng(seed)
    lengths = [3, 7, 150, 40, 90, 1, 64, 130, 20][:n]
    return [{"prompt_token_ids": rng.integers(0, 256, size=n).tolist()} for n in lengths]


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def models(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pcp_engine")
    return {
        "llama": str(tiny_model_dirs["llama"]),
        "deepseek_v3": str(save_tiny_model(tiny_deepseek_configs()["v3"], root / "v3")),
    }


@pytest.fixture(scope="module")
def one_rank(models) -> dict[str, list[list[int]]]:
    out = {}
    for name, path in models.items():
        with LLM(path) as llm:
            out[name] = tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("shm", ["1", "0"])
def test_two_ranks_generate_what_one_rank_does(model, shm, models, one_rank, monkeypatch):
    """Chunked prefill (budget 64), a KV cache too small for all requests
    (preemption), short prompts split or not (pcp_min_tokens). Steps without a
    split row: on one host led by rank 0, which sends their KV to rank 1;
    across hosts (CTXPAR_SHM=0: gloo) replicated or assigned to one rank each
    (pcp_spread_min_rows=0: every step of decodes spreads them)."""
    monkeypatch.setenv("CTXPAR_SHM", shm)
    configs = (
        [dict(pcp_min_tokens=0), dict(pcp_min_tokens=50)]
        if shm == "1"
        else [dict(pcp_min_tokens=50), dict(pcp_min_tokens=50, pcp_spread_min_rows=0)]
    )
    for kwargs in configs:
        with LLM(
            models[model],
            pcp_size=2,
            max_num_batched_tokens=64,
            num_kv_blocks=40,
            block_size=8,
            max_model_len=200,
            **kwargs,
        ) as llm:
            assert (llm.engine.executor.group.shm is not None) == (shm == "1")
            assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == one_rank[model], kwargs
            assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.multiprocess
def test_requests_arriving_and_finishing_at_different_steps(models, one_rank):
    """Requests join a running batch between steps and leave with different lengths."""
    ps = prompts()
    with LLM(models["llama"], pcp_size=2, pcp_min_tokens=0, max_num_batched_tokens=48) as llm:
        engine = llm.engine
        index, got, finished_at = {}, {}, {}
        pending = list(enumerate(ps))
        while pending or engine.has_unfinished_requests():
            if pending:  # one new request every step
                i, p = pending.pop(0)
                index[engine.add_request(p["prompt_token_ids"], GREEDY)] = i
            for out in engine.step():
                if out.finished:
                    got[index[out.request_id]] = list(out.outputs[0].token_ids)
                    finished_at[out.request_id] = engine.num_steps
    assert [got[i] for i in range(len(ps))] == one_rank["llama"]
    assert len(set(finished_at.values())) > 1  # they really left at different steps


@pytest.mark.multiprocess
def test_three_ranks_match_transformers(models):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32)
    p = prompts()[2]["prompt_token_ids"]
    want = transformers_greedy(ref, p, 12)
    with LLM(models["llama"], pcp_size=3, pcp_min_tokens=0) as llm:
        assert tokens(llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)) == [want]


@pytest.mark.multiprocess
def test_smollm2_two_ranks_teacher_forced_logits():
    """The real model: teacher-forced logits at P=2 equal P=1's to 1e-5 of the
    logit scale (greedy chat at P=2 against P=1: tests/models/test_smollm2_reference.py).

    The tolerance is relative to max |logit| (~30 here): fp32 GEMMs round
    differently for different row counts, and over 30 layers that leaves
    ~1.5e-6 of the scale (measured), as batching does at P=1 too.
    """
    plans = scripted_plans(vocab=49152)
    for step, (a, b) in enumerate(zip(run_plans(None, plans, 1), run_plans(None, plans, 2))):
        scale = a.abs().max().item()
        torch.testing.assert_close(b, a, atol=1e-5 * scale, rtol=0, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.multiprocess
def test_killed_worker_fails_fast_and_leaves_no_process(models):
    """With recovery off (max_rank_recoveries=0; tests/executor/test_rank_recovery.py has it on)."""
    llm = LLM(models["llama"], pcp_size=2, max_rank_recoveries=0)
    llm.generate(prompts(2), GREEDY, use_tqdm=False)
    (worker,) = multiprocessing.active_children()
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1"):
        llm.generate(prompts(2), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.close()
    assert multiprocessing.active_children() == []


@pytest.mark.multiprocess
def test_hung_worker_fails_within_the_timeout(models, monkeypatch):
    """A worker that stops answering (alive, sockets open) cannot be told from
    a slow one except by time: rank 0 raises RankFailure after the collective
    timeout (CTXPAR_COLLECTIVE_TIMEOUT_S, here 3 s) instead of hanging, and kills it."""
    monkeypatch.setenv("CTXPAR_COLLECTIVE_TIMEOUT_S", "3")
    llm = LLM(models["llama"], pcp_size=2, pcp_min_tokens=0)
    (worker,) = multiprocessing.active_children()
    os.kill(worker.pid, signal.SIGSTOP)  # alive but silent: only the timeout can notice
    start = time.monotonic()
    try:
        with pytest.raises(RankFailure, match="silent for 3 s"):
            llm.generate(prompts(3), GREEDY, use_tqdm=False)
        assert 2.5 < time.monotonic() - start < 20
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)
        llm.close()
    assert multiprocessing.active_children() == []


@pytest.mark.multiprocess
def test_no_process_left_after_with_close_or_gc(models):
    with LLM(models["llama"], pcp_size=2):
        assert len(multiprocessing.active_children()) == 1
    assert multiprocessing.active_children() == []
    llm = LLM(models["llama"], pcp_size=2)
    del llm
    gc.collect()
    assert multiprocessing.active_children() == []


def test_invalid_sizes_are_clear_errors(models):
    with pytest.raises(CtxparError, match="pcp_size"):
        LLM(models["llama"], pcp_size=0)
    if not torch.cuda.is_available():
        pytest.skip("the one-GPU-per-rank check needs CUDA")
    with pytest.raises(CtxparError, match="GPU"):
        LLM(models["llama"], pcp_size=torch.cuda.device_count() + 1, device="cuda")


@pytest.mark.multiprocess
@pytest.mark.parametrize("dcp", [1, 2], ids=["replicated-KV", "sharded-KV"])
def test_torchrun_rank0_drives_and_others_serve(models, tmp_path, one_rank, dcp):
    """Under torchrun every process runs the same script; only rank 0 returns
    from LLM(). The same with the KV cache sharded over the two ranks."""
    script = tmp_path / "run.py"
    here = os.path.dirname(__file__)
    script.write_text(
        textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]  # this module, helpers
        from ctxpar import LLM, SamplingParams
        from test_pcp_engine import prompts, tokens, GREEDY
        with LLM({models["llama"]!r}, pcp_size=2, dcp_size={dcp}, pcp_min_tokens=0) as llm:
            print("TOKENS", json.dumps(tokens(llm.generate(prompts(), GREEDY, use_tqdm=False))))
    """)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", CTXPAR_CLUSTER_SECRET=secrets.token_hex(32))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(script),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [l for l in done.stdout.splitlines() if l.startswith("TOKENS")]
    assert len(lines) == 1  # rank 1 served and exited without generating
    import json

    assert json.loads(lines[0][len("TOKENS ") :]) == one_rank["llama"]
