"""`ctxpar calibrate --link 1gbit`: a gloo all-gather between two network
namespaces joined by a veth shaped to 1 Gbit/s is timed, and its latency and
bandwidth become the saved profile's link, which `ctxpar estimate --hardware`
then uses. The namespaces are gone afterwards, also when the measurement fails.

Needs root and iproute2, as CI has: where a namespace cannot be made the test
fails with the reason (it is not skipped).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ctxpar import cli
from ctxpar.costmodel import load_hardware, load_model_shape
from ctxpar.costmodel.link_calibration import measure_shaped_link
from ctxpar.errors import RankFailure
from helpers.calibration import small_rank_figures

pytestmark = pytest.mark.multiprocess  # ranks in namespaces, and calibrate's local ones


def our_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in listed.splitlines() if f"ctxpar-links-{os.getpid()}-" in line]


def test_calibrate_saves_the_shaped_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    small_rank_figures(monkeypatch)  # the rank's figures: not what this test is about
    out = tmp_path / "profile.json"
    code = cli.main(["calibrate", "--device", "cpu", "--threads", "1", "--link", "1gbit", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "all-gather over 1gbit" in printed and not our_namespaces()
    profile = load_hardware(str(out))
    # gloo over the shaped veth: below the 0.125 GB/s of 1 Gbit/s (0.07 measured by bench links).
    assert 0.02e9 < profile.link_bandwidth < 0.13e9
    assert 1e-6 < profile.link_latency_s < 0.05
    assert profile.link_bandwidth == profile.notes["1gbit_bandwidth"]
    assert "1 Gbit/s Ethernet" in profile.description
    times = [v for k, v in profile.notes.items() if k.startswith("1gbit_allgather_")]
    assert len(times) == 4 and times == sorted(times)  # 4 KiB, 4, 16 and 64 MiB

    # estimate reads it: at P = 2 each layer's all-gather brings each rank the other's 4096 tokens of KV.
    argv = ["estimate", "--model", "smollm2-135m", "--context", "8192", "--pcp", "2", "--dcp", "1", "--json"]
    assert cli.main([*argv, "--hardware", str(out)]) == 0
    [row] = [r for r in json.loads(capsys.readouterr().out) if r["algorithm"] == "gather"]
    m = load_model_shape("smollm2-135m")
    layer = profile.link_latency_s + 4096 * m.kv_entries_per_token * profile.act_bytes / profile.link_bandwidth
    assert row["ttft_breakdown"]["comm_s"] == pytest.approx(m.num_layers * layer)


def test_an_overrun_kills_the_ranks_and_removes_the_namespaces() -> None:
    with pytest.raises(RankFailure, match="--link-timeout 1 s"):
        measure_shaped_link("1gbit", timeout_s=1)  # python and torch do not even start in a second
    assert not our_namespaces()


def test_without_root_a_clear_error_before_measuring(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert cli.main(["calibrate", "--link", "10gbit", "--out", os.devnull]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and "root" in captured.err and "Traceback" not in captured.err
    assert "GEMM" not in captured.out  # refused before the rank's measurements
