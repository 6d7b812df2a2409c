"""`ctxpar plan` and `ctxpar bench planner` through the real CLI entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ctxpar import cli

# cli.main imports only the module of the command it is given: these tests need no other's.


def test_single_prompt_two_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--prompt-lens", "10", "--pcp", "2"]) == 0
    out = capsys.readouterr().out
    # 10 tokens, 4 chunks of 3, 3, 2, 2: rank 0 gets chunks 0 and 3, rank 1 chunks 1-2; 5 each.
    assert "rank 0: 5 tokens" in out and "rank 1: 5 tokens" in out
    assert "chunks 1-2" in out and "chunk 3" in out
    assert "1.091" in out  # work 25 vs 30


def test_mixed_batch_four_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--prompt-lens", "8000", "3000", "--cached", "0", "1000", "--decodes", "4", "--pcp", "4"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    # 8000 + 2000 prompt tokens split 2500 per rank; the step splits, so (as in the
    # engine) the 4 decodes go to one rank each instead of every rank.
    assert "10004 tokens this step" in out
    for k in range(4):
        assert f"rank {k}: 2501 tokens" in out
    assert out.count("assigned") == 4 and "replicated" not in out


def test_decodes_alone_replicate_below_spread_min_rows(capsys: pytest.CaptureFixture[str]) -> None:
    # No split prompt: 3 decodes stay replicated below --spread-min-rows, and are assigned from it.
    assert cli.main(["plan", "--decodes", "3", "--pcp", "2"]) == 0
    assert capsys.readouterr().out.count("replicated") == 3 * 2
    assert cli.main(["plan", "--decodes", "3", "--pcp", "2", "--spread-min-rows", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("assigned") == 3 and "replicated" not in out


def test_png_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")  # an optional extra: ctxpar[plot]
    png = tmp_path / "plan.png"
    assert cli.main(["plan", "--prompt-lens", "100", "7", "--decodes", "2", "--pcp", "3", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in capsys.readouterr().out


@pytest.mark.parametrize(
    "bad",
    [
        ["--prompt-lens", "-5"],
        ["--prompt-lens", "10", "20", "--cached", "3"],
        ["--prompt-lens", "10", "--cached", "10"],
        ["--prompt-lens", "10", "--pcp", "0"],
        ["--prompt-lens", "10", "--replicate-below", "-1"],
        ["--prompt-lens", "10", "--spread-min-rows", "-1"],
        ["--decodes", "0"],
    ],
)
def test_bad_input_exits_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_png_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert cli.main(["plan", "--prompt-lens", "10", "--png", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_bench_planner_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # One call per configuration: checks both planners agree on every benchmark batch.
    assert cli.main(["bench", "planner", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out and "DualChunkSwap" in out


@pytest.mark.multiprocess
def test_output_into_a_closed_pipe_ends_quietly() -> None:
    # `ctxpar plan ... | head -1`: the reader leaves early. The output (~340 KB) is
    # larger than a pipe's buffer, so the writer is still writing when the pipe
    # closes: no traceback, exit 141 (128 + SIGPIPE) as a shell tool would.
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctxpar.cli", "plan", "--prompt-lens", "3000", "--decodes", "4000", "--pcp", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141
    assert first.startswith("PCP layout over 4 rank(s)") and err == ""
