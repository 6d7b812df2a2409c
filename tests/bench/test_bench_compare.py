"""`ctxpar bench compare`: the workload script runs ctxpar end to end (vLLM is
not installed here: it is a peer in its own venv), and bad setups are refused."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from ctxpar.bench import compare, compare_workload
from ctxpar.cli import main


def test_workload_runs_ctxpar_and_reports_every_figure(tiny_model_dirs):
    spec = {
        "model": str(tiny_model_dirs["llama"]),
        "max_model_len": 128,
        "prompts": {"4": [1, 2, 3, 4], "20": list(range(50, 70)), "40": list(range(5, 45))},
        "ttft": [40, 20],  # 40 from the decode runs' first tokens, 20 by a generate of its own
        "decode_after": [40, 4],
        "decode_tokens": 3,
        "batch_prompts": [[7, 8, 9], list(range(10, 30))],
        "batch_max_tokens": 5,
        "repeat": 1,
        "perplexity": {"text": list(range(3, 90))},
    }
    res = compare_workload.run("ctxpar", spec)
    assert set(res["figures"]) == {"ttft_40", "ttft_20", "decode_40", "decode_4", "batch", "ppl_text"}
    assert all(v > 0 for v in res["figures"].values())
    assert [len(s) for s in res["tokens"]["batch"]] == [5, 5]
    assert [len(s) for s in res["tokens"]["decode_40"]] == [4]
    # The perplexity against transformers' on the same weights and ids.
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    ids = torch.tensor([spec["perplexity"]["text"]])
    with torch.no_grad():
        want = math.exp(model(ids, labels=ids).loss.item())
    assert res["figures"]["ppl_text"] == pytest.approx(want, rel=1e-4)


def test_missing_peer_python_is_refused(capsys):
    assert main(["bench", "compare", "--peer-python", "/nonexistent/python"]) == 2
    assert "--peer-python /nonexistent/python does not exist" in capsys.readouterr().err
    assert main(["bench", "compare", "--peer", "llama.cpp", "--peer-python", "/nonexistent/python"]) == 2
    assert "the llama.cpp venv's python" in capsys.readouterr().err


def test_busy_machine_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(compare, "cpu_busy", lambda seconds=1.0: 0.9)
    args = argparse.Namespace(max_busy=15, allow_busy=False)
    with pytest.raises(Exception, match="90% busy.*--allow-busy"):
        compare._wait_for_idle(args)
    assert compare._wait_for_idle(argparse.Namespace(max_busy=15, allow_busy=True)) == 0.9
    assert 0.0 <= compare.cpu_busy(0.05) <= 1.0


def test_report_puts_each_ctxpar_rank_count_against_the_peer(capsys):
    """--pcp 1 2: a column per ctxpar run, each ratio against the peer's best, and the
    P = 2 run's tokens checked against one rank's as well as the peer's."""

    def run(ttft: float, load: float, tokens: list[list[int]], ppl: float | None = None) -> dict:
        figures = {"ttft_2048": ttft} | ({"ppl_english": ppl} if ppl else {})
        return {"load_s": load, "figures": figures, "tokens": {"batch": tokens}}

    results = {
        "ctxpar": [run(2.0, 1.0, [[1, 2], [3, 4]], 10.0), run(1.5, 1.0, [[1, 2], [3, 4]], 10.0)],
        "ctxpar-p2": [run(1.2, 2.0, [[1, 2], [3, 5]])],
        "llama.cpp": [run(6.0, 0.5, [[1, 2], [3, 4]], 10.05)],
    }
    compare._report(results, [0.01, 0.03], "llama.cpp")
    out = capsys.readouterr().out
    ttft = next(line for line in out.splitlines() if line.startswith("TTFT, 2048"))
    assert f"{1.5 / 6.0:8.2f}x" in ttft and f"{1.2 / 6.0:8.2f}x" in ttft and "ctxpar P=2" in out
    ppl = next(line for line in out.splitlines() if line.startswith("perplexity, English"))
    assert "same" in ppl and ppl.rstrip().endswith("-")  # no perplexity run at P = 2
    assert "token identity, ctxpar P=1: 2/2 generated sequences identical vs llama.cpp" in out
    assert "token identity, ctxpar P=2: 1/2 generated sequences identical vs llama.cpp, 1/2" in out
