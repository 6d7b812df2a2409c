"""`ctxpar bench bf16` at a size a test affords: every path this CPU has timed on each
case (the tiles and the panel loop where the CPU has AMX-BF16), and --e2e's TTFT and
decode of a bf16 SmolLM2 on each."""

from __future__ import annotations

import re

import pytest

from ctxpar import cli, kernels
from ctxpar.bench import bf16_projections
from ctxpar.machine import cpu_info

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the compiled kernels")


def test_each_path_timed(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf16_projections, "CASES", ((1, 2), (20, 1)))
    args = ["bench", "bf16", "--repeat", "1", "--e2e", "--prompt-tokens", "40", "--decode-tokens", "2"]
    assert cli.main(args) in (0, None)
    out = capsys.readouterr().out
    tiles = "amx_bf16" in cpu_info().flags
    paths = ["tiles", "panels"] if tiles and "avx512_bf16" in cpu_info().flags else ["tiles"] if tiles else ["panels"]
    assert re.search(r"rows x layers \| " + r" \| ".join(rf"\s*{p} ms" for p in [*paths, "oneDNN"]), out)
    rows = re.findall(r"^\s+(\d+) x (\d+)\s+\|(.*)\|", out, re.M)
    assert [(int(n), int(layers)) for n, layers, _ in rows] == [(1, 2), (20, 1)]
    assert all(len(ms.split("|")) == len(paths) + 1 for _, _, ms in rows)
    for p in paths:
        assert re.search(rf"^\s*{p}: TTFT [\d.]+ s, decode [\d.]+ ms/token$", out, re.M)
