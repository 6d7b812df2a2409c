"""`ctxpar bench serve`: a real server process under a small concurrency sweep.

The served greedy tokens are checked against offline LLM.generate by the
benchmark itself (its "identical" column); here every request must match.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.multiprocess
def test_sweep_prints_each_level_and_the_ratios(tiny_model_dirs):
    argv = [
        "bench",
        "serve",
        "--model",
        str(tiny_model_dirs["llama"]),
        "--concurrency",
        "1",
        "3",
        "--num-prompts",
        "5",
        "--output-len",
        "4",
        "--max-prompt-len",
        "96",
        "--threads",
        "1",
    ]
    r = subprocess.run([sys.executable, "-m", "ctxpar.cli", *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {int(m[1]): m for m in re.finditer(r"^ ?(\d+) +([\d.]+) +([\d.]+) .* (\d+)/(\d+)$", r.stdout, re.M)}
    assert sorted(rows) == [1, 3], r.stdout
    for m in rows.values():
        assert float(m[2]) > 0 and float(m[3]) > 0
        assert m[4] == m[5] == "5", r.stdout  # every request token-identical to offline
    assert re.search(r"throughput served\(C=\d\)/offline [\d.]+x, TTFT p50 offline/served\(C=1\) [\d.]+x", r.stdout)


def test_only_loopback_urls(capsys):
    from ctxpar import cli

    assert cli.main(["bench", "serve", "--url", "http://example.com:8000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --url must be an http:// loopback address") and "example.com" in err
