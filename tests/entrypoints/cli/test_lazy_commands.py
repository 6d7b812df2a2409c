"""A `ctxpar` command imports only its own module: `ctxpar bench cuda` on a GPU
machine without the server's packages (pydantic, fastapi) must not fail in
`ctxpar serve`'s imports (it did, on the first GPU run)."""

from __future__ import annotations

import sys

import pytest

from ctxpar import cli


def test_a_command_runs_without_the_other_commands_modules(monkeypatch, capsys) -> None:
    for other in ("ctxpar.entrypoints.cli.serve", "ctxpar.entrypoints.cli.generate", "ctxpar.bench.cuda"):
        monkeypatch.setitem(sys.modules, other, None)  # importing it now raises ImportError
    assert cli.main(["plan", "--prompt-lens", "10", "--pcp", "2"]) == 0
    assert "rank 1: 5 tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])  # lists every command from its one-line help
    assert e.value.code == 0
    assert "serve" in capsys.readouterr().out
