"""DCP's choice between gathering a split prompt's cached context and passing its
queries (ctxpar/layers/sharded_context.py), as the engine derives it at start-up from
the hardware profile (ctxpar/parallel/context_cost.py, ctxpar/costmodel/policy.py):
short contexts gather, long ones pass the queries, where the model's arithmetic says;
a dcp_gather_ratio the user sets wins. (Both paths' exactness against one rank:
tests/parallel/test_dcp_gather.py, which forces each.)"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from ctxpar.bench.long import SMOLLM2_SHAPES
from ctxpar.config import EngineConfig
from ctxpar.costmodel import HardwareProfile, load_hardware, load_model_shape
from ctxpar.costmodel.policy import derive_policy
from ctxpar.engine.arg_utils import EngineArgs
from ctxpar.layers.sharded_context import GatherPolicy, gathers_context
from ctxpar.parallel.context_cost import ContextCost
from ctxpar.worker.options import RunnerOptions, context_gather

SMOLLM2 = load_model_shape("smollm2-135m")
# SmolLM2's local tensors of a 2048-token chunk on two ranks: 9 query heads, 3 KV heads of 64, fp32.
Q, ENTRIES = torch.empty(1024, 9, 64), torch.empty(1024, 2, 3, 64)


def derived(hardware: HardwareProfile, workspace: int = 2048) -> GatherPolicy:
    policy = derive_policy(SMOLLM2, hardware, 2, 2)
    return context_gather(EngineConfig(pcp_size=2, dcp_size=2, max_num_batched_tokens=workspace), policy)


def crossover(policy: GatherPolicy, exchange_anyway: bool = False) -> int:
    """The shortest context (in steps of 64) that passes the queries; every shorter one gathers."""
    picks = [gathers_context(policy, c, Q, ENTRIES, 64, 2, exchange_anyway) for c in range(64, 65536, 64)]
    first = picks.index(False)
    assert all(picks[:first]) and not any(picks[first:]), "one switch, from gather to pass-Q"
    return 64 * (first + 1)


@pytest.mark.parametrize("profile", ["cpu-core-shm", "cpu-core-gloo"])
def test_derived_rule_matches_the_measured_crossover(profile: str) -> None:
    """ctxpar bench dcp part (e) measured gathering faster at 2K and 4K of context and
    pass-Q faster at 8K (docs/benchmarks.md); with decodes in the step (partials
    exchanged anyway) gathering lost already at 4K."""
    policy = derived(load_hardware(profile))
    assert 4096 < crossover(policy) <= 8192
    assert 2048 < crossover(policy, exchange_anyway=True) <= 4096


def test_latency_and_rounds_move_the_crossover() -> None:
    """Every round of gathering is a collective: a slower step, or a smaller workspace
    (more rounds), makes pass-Q win at shorter contexts."""
    cpu = load_hardware("cpu-core-gloo")
    base = crossover(derived(cpu))
    slower = [crossover(derived(dataclasses.replace(cpu, link_latency_s=s))) for s in (1e-3, 5e-3, 20e-3)]
    assert base > slower[0] > slower[1] > slower[2]
    assert crossover(derived(cpu, workspace=128)) < base


def test_predicted_seconds() -> None:
    """The arithmetic of ctxpar/parallel/context_cost.py on round numbers."""
    cost = ContextCost(latency_s=1e-3, link_bytes_per_s=1e9, memory_bytes_per_s=1e10)
    # 2 rounds of one step, 1 MB over the link, the 2 MB context reordered and read (3x).
    assert cost.gather_s(2, 2, 1e6, 2e6) == pytest.approx(2e-3 + 1e-3 + 0.6e-3)
    # 1 MB of queries; 1 MB of partials in one step, merged (3 MB of memory); half the context read.
    assert cost.pass_q_s(2, 1e6, 1e6, 2e6) == pytest.approx(1e-3 + (1e-3 + 1e-3 + 0.3e-3) + 0.1e-3)
    assert cost.pass_q_s(2, 1e6, 0, 2e6) == pytest.approx(1e-3 + 0.1e-3)  # partials exchanged anyway


def runner_rule(**config: Any) -> tuple[GatherPolicy, str]:
    """The rule and the policy's description the engine's start-up gives SmolLM2 at P = D = 2."""
    hf = LlamaConfig(**SMOLLM2_SHAPES, num_hidden_layers=30)
    options = RunnerOptions.from_config(EngineConfig(pcp_size=2, dcp_size=2, **config), 4, hf)
    assert options.policy is not None
    return options.context_gather, options.policy.describe()


def test_a_set_ratio_wins() -> None:
    auto, said = runner_rule(hardware_profile="cpu-core-shm")
    assert auto.cost is not None and "gather or pass-Q: the faster predicted (link 59 us + 0.38 GB/s" in said
    assert auto.workspace_tokens == 2048  # max_num_batched_tokens
    assert [gathers_context(auto, c, Q, ENTRIES, 64, 2, False) for c in (64, 8192)] == [True, False]

    for ratio, gathers in ((0.0, False), (100.0, True)):
        rule, said = runner_rule(hardware_profile="cpu-core-shm", dcp_gather_ratio=ratio)
        assert rule.cost is None and f"dcp_gather_ratio={ratio:g} (set: gather when its bytes are below" in said
        assert [gathers_context(rule, c, Q, ENTRIES, 64, 2, False) for c in (64, 8192)] == [gathers, gathers]
    assert "dcp_gather_ratio" in derive_policy(SMOLLM2, load_hardware("cpu-core-shm"), 2, 2).derived


def test_the_flag_reaches_the_config() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--pcp", "2", "--dcp", "2", "--dcp-gather-ratio", "0.5"])
    assert EngineArgs.from_cli_args(args).create_engine_config().dcp_gather_ratio == 0.5
