"""`ctxpar bench overhead` runs the real scheduler, planner and slot maps without a model."""

from __future__ import annotations

import re

from ctxpar import cli


def test_prints_a_row_per_context_and_step(capsys):
    assert cli.main(["bench", "overhead", "--contexts", "64", "256", "--steps", "3", "--chunk", "32"]) in (0, None)
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+) \|\s+(decode|prefill) \|(.*)$", out, re.M)
    assert [(c, s) for c, s, _ in rows] == [("64", "decode"), ("64", "prefill"), ("256", "decode"), ("256", "prefill")]
    for _, _, cells in rows:
        assert len(re.findall(r"\d+ \(\s*[\d.]+x\)", cells)) == 4
