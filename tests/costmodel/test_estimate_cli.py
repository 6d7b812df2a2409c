"""`ctxpar estimate`: the JSON output's shape and the errors for bad input."""

from __future__ import annotations

import json

import pytest

from ctxpar.entrypoints.cli.main import main

KEYS = {"pcp", "dcp", "algorithm", "ttft_s", "decode_ms", "memory_gib_per_rank"}


def test_json_lists_every_layout(capsys):
    argv = ["estimate", "--model", "llama-3-70b", "--hardware", "h100x8-ib", "--context", "65536", "--cached", "1000"]
    assert main([*argv, "--pcp", "1", "2", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(KEYS <= row.keys() for row in rows)
    assert {(r["pcp"], r["dcp"]) for r in rows} == {(1, 1), (2, 1), (2, 2), (4, 1), (4, 4)}
    assert sum(r["recommended"] for r in rows) == 1


def test_table_marks_the_recommendation(capsys):
    assert main(["estimate", "--model", "qwen3-32b", "--hardware", "h100x8-ib", "--context", "32768"]) == 0
    assert "<- recommended" in capsys.readouterr().out


def test_config_json_model(tmp_path, capsys):
    cfg = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["estimate", "--model", str(tmp_path), "--hardware", "h100x8-tcp", "--context", "4096", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt-9", "--hardware", "h100x8-ib", "--context", "10"], "neither a built-in"),
        (["--model", "llama-3-8b", "--hardware", "tpu", "--context", "10"], "neither a built-in profile"),
        (["--model", "llama-3-8b", "--hardware", "h100x8-ib", "--context", "10", "--cached", "10"], "cached"),
        (
            ["--model", "llama-3-8b", "--hardware", "h100x8-ib", "--context", "10", "--pcp", "2", "--dcp", "3"],
            "DCP size",
        ),
    ],
)
def test_errors_are_one_line_without_traceback(argv, message, capsys):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_plot_has_a_line_per_p_and_the_published_points(tmp_path):
    from ctxpar.costmodel.published import META_CP_TTFT

    out = tmp_path / "plot.svg"
    assert main(["estimate", "--model", "llama-3-405b", "--hardware", "h100x8-ib", "--context", "131072"]
                + ["--plot", str(out), "--pcp", "1", "2", "4"]) == 0  # fmt: skip
    text = out.read_text()
    assert text.startswith("<svg") and text.rstrip().endswith("</svg>")
    assert text.count("<polyline") == 3  # P = 1, 2, 4 over 8K..128K
    measured = [pt for pt in META_CP_TTFT if pt.pcp in (1, 2, 4) and pt.context <= 131072]
    assert text.count("<circle") == len(measured) + 1  # and the legend's
