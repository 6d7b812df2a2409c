"""Decode context parallelism on real ranks (gloo): with the KV cache sharded
over D = P ranks, teacher-forced logits equal one rank's, and the union of the
ranks' shards is the one-rank cache, entry for entry, each entry stored once;
and a token's logits are the same bits however its steps are cut.

The script (pcp_harness.scripted_plans) mixes decodes, fresh prefills,
continued chunks and prompts of 3 and 5 tokens, shorter than D·I for the
larger interleaves (some ranks' shards of them are empty). pcp_min_tokens=25
replicates its short prompts instead of splitting them (multi-token rows with
queries on every rank).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxpar.parallel.dcp_shard import DCPShard
from helpers.dcp_harness import Job, run_groups, run_single, shard_slots
from helpers.models import TINY_COMMON, save_tiny_model
from helpers.pcp_harness import BLOCK_SIZE, four_families, scripted_plans

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

MODELS = ("llama", "qwen3", "deepseek_v2", "deepseek_v3")
# (interleave, pcp_min_tokens): 1, a divisor between, block_size; split and replicated short prompts
SETTINGS = ((1, 0), (2, 0), (BLOCK_SIZE, 0), (2, 25))
SIZES = [2, 3, 4]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    return four_families(tiny_model_dirs, tmp_path_factory.mktemp("dcp_models"))


@pytest.fixture(scope="module")
def plans():
    return scripted_plans(vocab=256)


@pytest.fixture(scope="module")
def single(model_dirs, plans):
    return {name: run_single(d, plans) for name, d in model_dirs.items()}


@pytest.fixture(scope="module")
def all_groups(model_dirs, plans, tmp_path_factory):
    """Groups of P = D = 2, 3, 4 ranks each run every (model, setting): {P: {(model, setting): Result}}."""
    keys = [(m, s) for m in MODELS for s in SETTINGS]
    jobs = [Job(model_dirs[m], cp_interleave=i, pcp_min_tokens=mn) for m, (i, mn) in keys]
    results = run_groups(SIZES, jobs, plans, tmp_path_factory.mktemp("dcp"))
    return {P: dict(zip(keys, r)) for P, r in results.items()}


@pytest.fixture(params=SIZES, ids=lambda p: f"P=D={p}")
def group_results(request, all_groups):
    return request.param, all_groups[request.param]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"I={s[0]},min={s[1]}")
@pytest.mark.parametrize("model", MODELS)
def test_teacher_forced_logits_match_one_rank(group_results, single, model, setting):
    _, results = group_results
    got, want = results[model, setting].logits, single[model].logits
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"step {step}"
        tol = 1e-5 * w.abs().max().item()
        torch.testing.assert_close(g, w, atol=tol, rtol=0, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("setting", SETTINGS[:3], ids=lambda s: f"I={s[0]}")
@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_union_of_shards_is_the_one_rank_cache(group_results, single, plans, model, setting):
    """Every computed entry is on exactly its owner, equal to the one-rank entry;
    every other slot of every rank was never written (the caches start zeroed)."""
    P, results = group_results
    caches = results[model, setting].caches
    for rank, layers in enumerate(caches):
        mine, ref = shard_slots(plans, DCPShard(P, setting[0], rank))
        for layer, (cache, full) in enumerate(zip(layers, single[model].caches[0])):
            want = full[torch.from_numpy(ref)]
            tol = 1e-5 * full.abs().max().item()
            torch.testing.assert_close(cache[torch.from_numpy(mine)], want, atol=tol, rtol=0)
            assert want.flatten(1).abs().amax(1).min() > 0, "a reference entry was never written"
            untouched = np.ones(len(cache), dtype=bool)
            untouched[mine] = False
            assert not cache[torch.from_numpy(untouched)].any(), f"rank {rank} layer {layer}: stray writes"


def test_pytorch_path_without_kernels_matches_one_rank(model_dirs, plans, single, tmp_path, monkeypatch):
    """CTXPAR_KERNELS=0 (the path on a GPU, or without a C++ compiler): decode
    rows attend their shards one by one instead of in the compiled kernel; the
    logits still equal one rank's. The ranks inherit the variable at spawn."""
    monkeypatch.setenv("CTXPAR_KERNELS", "0")
    models = ("llama", "deepseek_v3")
    results = run_groups([2], [Job(model_dirs[m]) for m in models], plans, tmp_path)[2]
    for model, res in zip(models, results):
        want = single[model].logits
        assert len(res.logits) == len(want)
        for step, (g, w) in enumerate(zip(res.logits, want)):
            torch.testing.assert_close(
                g, w, atol=1e-5 * w.abs().max().item(), rtol=0, msg=lambda m: f"step {step}: {m}"
            )


# Requests 3-5 repeat 0-2's tokens. Alone: each prompt in one step, then decodes. Mixed:
# the prompts cut elsewhere and side by side (the context boundary moves), decodes among
# them, and a two-token row past a prompt (a verify of a draft).
ALONE = [[(0, 37)], [(0, 1)], [(0, 1)], [(1, 21)], [(1, 1)], [(1, 1)], [(2, 50)], [(2, 1)], [(2, 1)]]
MIXED = [[(3, 10), (4, 21)], [(3, 27), (4, 1), (5, 7)], [(3, 1), (5, 30), (4, 1)], [(5, 13), (3, 1)], [(5, 2)]]


def logits_by_position(plans, steps, prompt_len, logits) -> dict[tuple[int, int], torch.Tensor]:
    """{(request mod 3, position): logits row} of every row that computed logits."""
    done, got = dict.fromkeys(prompt_len, 0), {}
    for rows, step in zip(steps, logits):
        wanted = [(r, done[r] + n - 1) for r, n in rows if done[r] + n >= prompt_len[r]]
        for (r, pos), row in zip(wanted, step):
            got[r % 3, pos] = row
        for r, n in rows:
            done[r] += n
    return got


def test_a_tokens_bits_do_not_depend_on_how_its_steps_are_cut(tmp_path):
    """A tiny Llama whose heads the compiled kernels take (head_dim 64), P = D = 2, an
    fp32 and an int8 cache: every logits row the two scripts both compute is ==."""
    from transformers import LlamaConfig

    model = str(save_tiny_model(LlamaConfig(**TINY_COMMON, head_dim=64, tie_word_embeddings=False), tmp_path / "m"))
    prompt_len = {0: 37, 1: 21, 2: 50, 3: 37, 4: 21, 5: 50}
    plans = scripted_plans(256, 0, prompt_len, ALONE + MIXED, same_tokens={3: 0, 4: 1, 5: 2})
    jobs = [Job(model), Job(model, kv_cache_dtype="int8")]
    runs = tmp_path / "runs"
    runs.mkdir()
    for res in run_groups([2], jobs, plans, runs)[2]:
        alone = logits_by_position(plans, ALONE, prompt_len, res.logits[: len(ALONE)])
        mixed = logits_by_position(plans, MIXED, prompt_len, res.logits[len(ALONE) :])
        assert len(set(alone) & set(mixed)) == 8
        for key in set(alone) & set(mixed):
            assert torch.equal(alone[key], mixed[key]), key
