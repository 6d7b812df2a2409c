"""`ctxpar bench soak`: a few seconds of the random mix against a real server
process at P = 2, with rank 1 killed once; the benchmark itself checks every
answer, the recovery and the KV cache at the end."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers.tiny_tokenizer import with_byte_tokenizer


@pytest.mark.multiprocess
def test_short_soak_with_a_rank_killed_has_no_errors_and_frees_the_cache(tiny_model_dirs, tmp_path):
    model = with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path / "llama")  # chat needs a template
    argv = ["bench", "soak", "--model", str(model), "--duration", "6", "--concurrency", "3", "--report-every", "2"]
    argv += ["--pcp", "2", "--kill-rank-every", "3"]
    argv += ["--max-tokens", "8", "--max-prompt-words", "40", "--abort-rate", "0.3", "--bad-rate", "0.2"]
    argv += ["--threads", "1"]  # 40 words: at most ~300 byte tokens, within the tiny model's 512
    r = subprocess.run([sys.executable, "-m", "ctxpar.cli", *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    served = re.search(r"served (\d+) .* clients that left (\d+), bad requests refused with a 400 (\d+)", r.stdout)
    assert served and all(int(x) > 0 for x in served.groups()), r.stdout
    assert "errors by kind: none" in r.stdout and "KV cache at the end: fully free" in r.stdout
    assert re.search(r"RSS rank 0 / all: \d+ / \d+ MiB after warm-up, \d+ / \d+ MiB idle at the end", r.stdout)
    assert "ranks killed 1, found lost 1, recovered 1; /health healthy on 2 of 2 ranks" in r.stdout


def test_only_loopback_urls(capsys):
    from ctxpar import cli

    assert cli.main(["bench", "soak", "--url", "http://example.com:8000"]) == 2
    assert capsys.readouterr().err.startswith("error: --url must be an http:// loopback address")
    assert cli.main(["bench", "soak", "--kill-rank-every", "5"]) == 2  # P = 1: no rank to kill
    assert "--kill-rank-every needs a server started here (no --url) with --pcp 2" in capsys.readouterr().err
