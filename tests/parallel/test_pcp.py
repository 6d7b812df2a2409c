"""Prefill context parallelism across real processes (gloo): P ranks must give
exactly what one rank gives, for GQA and MLA models, on every kind of row."""

from __future__ import annotations

import pytest
import torch

from helpers.pcp_harness import assert_same_logits, four_families, run_plans, scripted_plans

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    return four_families(tiny_model_dirs, tmp_path_factory.mktemp("pcp_models"))


@pytest.fixture(scope="module")
def single_rank_logits(model_dirs) -> dict[str, list[torch.Tensor]]:
    plans = scripted_plans(vocab=256)
    return {name: run_plans(d, plans, pcp_size=1) for name, d in model_dirs.items()}


# P = 4 (more ranks than cores here, the slowest case) for one model of each attention kind.
CASES = [(m, p) for m in ("llama", "qwen3", "deepseek_v2", "deepseek_v3") for p in (2, 3)]
CASES += [("llama", 4), ("deepseek_v3", 4)]


@pytest.mark.parametrize(("model", "pcp_size"), CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_teacher_forced_logits_match_one_rank(model, pcp_size, model_dirs, single_rank_logits):
    """Every step mixes decodes, fresh and continued prefills and prompts shorter than 2P;
    every step splits a row, so its decodes are assigned, one rank each."""
    got = run_plans(model_dirs[model], scripted_plans(vocab=256), pcp_size)
    assert_same_logits(got, single_rank_logits[model])


@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_replicating_short_prefills_keeps_logits(model, model_dirs, single_rank_logits):
    """pcp_min_tokens=25: rows below it are not split: assigned beside a split row, replicated
    in steps 2 and 3, which split none and have fewer than pcp_spread_min_rows rows."""
    got = run_plans(model_dirs[model], scripted_plans(vocab=256), pcp_size=2, pcp_min_tokens=25)
    assert_same_logits(got, single_rank_logits[model])


@pytest.mark.parametrize("pcp_size", [2, 3])
@pytest.mark.parametrize("model", ["llama", "deepseek_v2"])  # qwen3 attends as llama does
def test_spreading_steps_without_a_split_row_keeps_logits(model, pcp_size, model_dirs, single_rank_logits):
    """pcp_min_tokens=25, pcp_spread_min_rows=0: the steps of decodes and short prompts only
    (steps 2 and 3) assign their rows too, one rank each, gathering their KV and hidden states."""
    got = run_plans(model_dirs[model], scripted_plans(vocab=256), pcp_size, pcp_min_tokens=25, pcp_spread_min_rows=0)
    assert_same_logits(got, single_rank_logits[model])
