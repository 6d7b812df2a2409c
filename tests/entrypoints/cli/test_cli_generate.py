"""`ctxpar generate`: streams text, ends with a timing line; bad input exits 2
with a one-line message and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.cli import main
from helpers.tiny_tokenizer import with_byte_tokenizer

ENV = dict(os.environ, PYTHONIOENCODING="utf-8")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    return with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("cli") / "llama_bytes")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ctxpar.cli", *args], capture_output=True, env=ENV, timeout=300, encoding="utf-8"
    )


@pytest.mark.multiprocess
def test_generate_streams_text_and_timing(model_dir):
    r = cli("generate", "--model", str(model_dir), "--prompt", "Hello", "--max-tokens", "12", "--ignore-eos", "-v")
    assert r.returncode == 0, r.stderr
    with LLM(str(model_dir)) as llm:
        [ref] = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        conv = [{"role": "user", "content": "hi"}]
        [chat] = llm.chat(conv, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert r.stdout == ref.outputs[0].text + "\n"
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "12 tokens" in last and "time to first token" in last and "tokens/s" in last
    assert "2 layers" in r.stderr and "bytes per token per layer" in r.stderr and "blocks of 16 tokens" in r.stderr

    r = cli("generate", "--model", str(model_dir), "--chat", "hi", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert r.stdout == chat.outputs[0].text + "\n"


@pytest.mark.multiprocess
def test_bad_value_exits_2_without_traceback(model_dir):
    r = cli("generate", "--model", str(model_dir), "--temperature", "-1")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: temperature must be >= 0 (0 = greedy), got -1.0"


@pytest.mark.parametrize(
    "args, words",
    [
        (["--top-p", "2"], ["top_p", "(0, 1]"]),
        (["--max-tokens", "0"], ["max_tokens", ">= 1"]),
        (["--top-k", "-2"], ["top_k", "-2"]),
        (["--min-p", "3"], ["min_p"]),
        (["--block-size", "0"], ["block_size"]),
        (["--max-model-len", "100000"], ["max_model_len", "512"]),
        (["--prompt", ""], ["empty"]),
        (["--prompt", "x" * 600], ["600 tokens", "max_model_len=512"]),
        (["--pcp", "0"], ["pcp_size"]),
    ],
)
def test_bad_input_exits_2(model_dir, capsys, args, words):
    assert main(["generate", "--model", str(model_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for w in words:
        assert w in err


def test_bad_model_and_missing_template(tiny_model_dirs, tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_model_dirs["qwen2"]), "--chat", "hi"]) == 2
    assert "chat template" in capsys.readouterr().err


def test_unparseable_number_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--max-tokens", "many"])
    assert e.value.code == 2
    assert "invalid int value" in capsys.readouterr().err


def test_sampling_flags_are_the_requests_fields():
    """Each sampling flag is the SamplingParams field of its name (SamplingFlags' table);
    the defaults are a terminal's: greedy, 256 tokens, no top-k."""
    import argparse
    import dataclasses

    from ctxpar.entrypoints.cli import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    defaults = generate.sampling_params(parser.parse_args([]))
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k, defaults.ignore_eos) == (0.0, 256, -1, False)
    argv = ["--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "3", "--min-p", "0.1"]
    given = generate.sampling_params(parser.parse_args([*argv, "--seed", "11", "--ignore-eos"]))
    assert given == dataclasses.replace(
        SamplingParams(), max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, seed=11, ignore_eos=True
    )
