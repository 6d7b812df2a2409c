"""The engine's PCP policy (ctxpar/costmodel/policy.py): thresholds derived from the
cost model move the right way with the link and the compute, a value the user set
wins, and the per-step groups of ranks are the ones the model predicts fastest."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from ctxpar.costmodel import HardwareProfile, load_hardware, load_model_shape
from ctxpar.costmodel.policy import NEVER, derive_policy, split_min_tokens, spread_rows
from ctxpar.costmodel.profiles import engine_hardware
from ctxpar.parallel.pcp_groups import split_groups

MODEL = load_model_shape("smollm2-135m")
CPU = load_hardware("cpu-core-gloo")


def faster(h: HardwareProfile, link: float = 1.0, compute: float = 1.0) -> HardwareProfile:
    return dataclasses.replace(
        h,
        link_bandwidth=h.link_bandwidth * link,
        link_latency_s=h.link_latency_s / link,
        gemm_flops=h.gemm_flops * compute,
        attention_flops=h.attention_flops * compute,
    )


@pytest.mark.parametrize("pcp", [2, 3])
def test_faster_links_split_and_spread_sooner(pcp: int) -> None:
    for threshold in (lambda h: split_min_tokens(MODEL, h, pcp, 1), lambda h: spread_rows(MODEL, h, pcp)):
        got = [threshold(faster(CPU, link=f)) for f in (0.1, 1.0, 10.0, 100.0)]
        assert got == sorted(got, reverse=True) and got[0] > got[-1], got


@pytest.mark.parametrize("pcp", [2, 3])
def test_faster_compute_splits_later(pcp: int) -> None:
    """Compute that shrinks against the collectives' cost makes splitting pay only for longer prompts."""
    got = [split_min_tokens(MODEL, faster(CPU, compute=f), pcp, 1) for f in (0.5, 1.0, 4.0, 100.0)]
    assert got == sorted(got) and got[0] < got[-1], got
    rows = [spread_rows(MODEL, faster(CPU, compute=f), pcp) for f in (0.5, 1.0, 100.0)]
    assert rows == sorted(rows), rows


def test_a_gpu_node_splits_later_than_a_cpu_core() -> None:
    gpu = load_hardware("h100x8-ib")
    assert split_min_tokens(MODEL, gpu, 2, 1) > 10 * split_min_tokens(MODEL, CPU, 2, 1)


def test_set_values_win_and_one_rank_splits_nothing() -> None:
    policy = derive_policy(MODEL, CPU, 2, 1, min_tokens=500, spread_min_rows=7, split_mode="whole")
    assert (policy.min_tokens, policy.spread_min_rows, policy.split_mode, policy.derived) == (500, 7, "whole", ())
    auto = derive_policy(MODEL, CPU, 2, 1)
    assert auto.derived == ("pcp_min_tokens", "pcp_spread_min_rows")
    assert "from the cost model" in auto.describe()
    one = derive_policy(MODEL, CPU, 1, 1)
    assert (one.min_tokens, one.spread_min_rows) == (0, NEVER)
    dcp = derive_policy(MODEL, CPU, 2, 2, split_mode="disjoint")  # DCP: groups too, decodes on every rank
    assert (dcp.split_mode, dcp.spread_min_rows) == ("disjoint", NEVER)


def groups(policy, q: list[int], c: list[int]) -> list[tuple[int, int]] | None:
    got = policy.split_ranks(np.array(q), np.array(c), np.ones(len(q), dtype=bool))
    return None if got is None else list(zip(got[0].tolist(), got[1].tolist()))


def test_auto_picks_per_step() -> None:
    """Equal prompts: one whole on each rank (fewer rows, no rank reads every context);
    unequal ones, or more prompts than balance over disjoint groups: every prompt over all."""
    p2, p3 = derive_policy(MODEL, CPU, 2, 1), derive_policy(MODEL, CPU, 3, 1)
    assert sorted(groups(p2, [1000, 1000], [0, 0]) or []) == [(0, 1), (1, 1)]
    assert sorted(groups(p2, [256, 256], [8000, 8000]) or []) == [(0, 1), (1, 1)]
    assert groups(p2, [4000, 500], [0, 0]) is None
    assert groups(p2, [300, 300, 300], [0, 0, 0]) is None
    assert groups(p2, [1000], [0]) is None  # one prompt: over all ranks
    assert sorted(groups(p3, [300, 300, 300], [0, 0, 0]) or []) == [(0, 1), (1, 1), (2, 1)]


def test_forced_modes() -> None:
    def forced(mode: str, pcp: int, q: list[int]) -> list[tuple[int, int]] | None:
        return groups(derive_policy(MODEL, CPU, pcp, 1, split_mode=mode), q, [0] * len(q))

    assert forced("all", 3, [900, 100]) is None
    assert forced("whole", 3, [900, 100]) == [(2, 1), (1, 1)]  # longest first, to the highest idle rank
    assert forced("disjoint", 3, [900, 100]) == [(0, 2), (2, 1)]  # ranks shared by work, one at least
    assert forced("disjoint", 2, [900]) is None  # one row: its group is every rank


def test_split_groups_cover_the_ranks() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        P, S = int(rng.integers(2, 9)), int(rng.integers(1, 12))
        work = rng.random(S)
        first, width = split_groups("disjoint", work, P)
        assert (width >= 1).all() and (first >= 0).all() and (first + width <= P).all()
        if S < P:  # disjoint groups that use every rank
            assert width.sum() == P and (first == np.cumsum(width) - width).all()
        else:
            assert (width == 1).all()
            loads = np.bincount(first, weights=work, minlength=P)
            assert loads.max() - loads.min() <= work.max() + 1e-12  # longest first: within one row


def test_engine_hardware(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert engine_hardware(None, one_host=True).name == "cpu-core-shm"
    assert engine_hardware(None, one_host=False).name == "cpu-core-gloo"
    assert engine_hardware("h100x8-ib", one_host=True).name == "h100x8-ib"
    (tmp_path / "hardware-profile.json").write_text(json.dumps({**dataclasses.asdict(CPU), "name": "calibrated-here"}))
    assert engine_hardware(None, one_host=True).name == "calibrated-here"


def test_an_unknown_profile_is_refused_before_loading() -> None:
    from ctxpar.config import EngineConfig
    from ctxpar.errors import CtxparError
    from ctxpar.executor.preflight import check_launch

    with pytest.raises(CtxparError, match="neither a built-in profile"):
        check_launch(EngineConfig(hardware_profile="no-such-profile"))


def test_dcp_evens_out_the_attention_whatever_the_groups() -> None:
    """Under DCP every query of a split row is attended over every rank's own shard of its
    keys, whichever ranks hold its queries: a long context no longer weighs on the rank its
    row is given to, so equal new parts go whole, one to a rank. At D = 1 the context is
    attended where the queries are: the row is split over all."""
    q, c = [512, 512], [60_000, 0]
    assert groups(derive_policy(MODEL, CPU, 2, 1), q, c) is None
    assert sorted(groups(derive_policy(MODEL, CPU, 2, 2), q, c) or []) == [(0, 1), (1, 1)]
