"""`ctxpar estimate`: the JSON output's shape and the errors for bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ctxpar.costmodel import shape_from_hf_config
from ctxpar.entrypoints.cli.main import main
from helpers.rates import rates

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


@pytest.fixture
def tiny_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Writes a 2-layer GGUF (head_dim 64 != hidden / heads, an untied LM head) in a format."""
    from ctxpar.bench import gguf_shapes
    from ctxpar.models.loader import default_model_path

    shape = gguf_shapes.Shape(512, 2, 4, 2, 64, 1024, 10000.0, tied=False)
    monkeypatch.setitem(gguf_shapes.SHAPES, "tiny", shape)
    return lambda fmt: gguf_shapes.write_gguf("tiny", fmt, tmp_path / f"tiny-{fmt}.gguf", default_model_path())


def test_a_gguf_file_is_its_metadata_shape_and_its_weights_dtype(tiny_gguf, tmp_path: Path, capsys) -> None:
    """A Q4_0 file: the shape the engine reads from its metadata (checked against the
    config.json of the same numbers) priced with q4 weights at the rates the profile's rates
    hold for q4, whatever dtype the profile was calibrated for."""
    from ctxpar.costmodel import load_hardware
    from ctxpar.costmodel.timing import decode_time, prefill_time
    from ctxpar.models.gguf import open_gguf

    path = tiny_gguf("Q4_0")
    vocab = open_gguf(path).array_lengths["tokenizer.ggml.tokens"]
    config = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4}
    config |= {"num_key_value_heads": 2, "head_dim": 64, "vocab_size": vocab, "tie_word_embeddings": False}
    fp32 = dataclasses.replace(
        load_hardware("cpu-core-shm"),
        lead=None,
        rates=rates({("gemm_flops", "q4"): 300e9, ("weight_read_bandwidth", "q4"): 9e9}),
    )
    profile = tmp_path / "profile.json"
    profile.write_text(fp32.to_json())
    argv = ["estimate", "--model", str(path), "--hardware", str(profile), "--context", "1024", "--pcp", "1"]
    assert main([*argv, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    shape = shape_from_hf_config(config, "tiny")
    q4 = dataclasses.replace(fp32, weight_dtype="q4", gemm_flops=300e9, weight_read_bandwidth=9e9)
    assert row["ttft_s"] == pytest.approx(prefill_time(shape, q4, 1024, 0, 1, 1, 1, "gather").total_s)
    assert row["decode_ms"] == pytest.approx(1e3 * decode_time(shape, q4, 1024, 1, 1).total_s)
    assert main(argv) == 0 and "q4 weights" in capsys.readouterr().out


def test_a_gguf_format_without_a_dtype_is_refused(tiny_gguf, capsys) -> None:
    argv = ["estimate", "--model", str(tiny_gguf("Q8_0")), "--hardware", "cpu-core-shm", "--context", "10"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "weights in Q8_0" in err and "Traceback" not in err
