"""`ctxpar bench long` on a short context: every configuration reports the one-rank tokens."""

from __future__ import annotations

import re

import pytest

from ctxpar import cli


@pytest.mark.multiprocess
def test_every_configuration_is_exact(capsys):
    argv = ["bench", "long", "--context", "600", "--pcp", "2", "--layers", "1", "--chunk", "256", "--new-tokens", "4"]
    assert cli.main(argv) in (0, None)
    rows = re.findall(r"^\s*(\d) \| (\d) \|\s+[\d.]+ \|\s+(\S+) \| (\S+)$", capsys.readouterr().out, re.M)
    assert [(p, d) for p, d, _, _ in rows] == [("1", "1"), ("2", "1"), ("2", "2")]
    assert all(same == "yes" and float(diff) <= 1e-4 for _, _, same, diff in rows)
