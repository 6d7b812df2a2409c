"""Every numeric argument of `ctxpar bench`, `ctxpar plan` and `ctxpar generate`
is validated before any work: a zero, negative, non-finite or absurd value
exits 2 with one `error:` line (argparse's usage error or ctxpar's own) and no
traceback. Nothing here loads a model except the KV-size case."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from ctxpar import cli
from ctxpar.bench.catalog import BENCHMARKS
from ctxpar.checks import fraction

# Options where 0 is meaningful: 0 skips the prefill timing, 0 splits every
# prompt, 0 is a seed like any other, 0 spreads every step's unsplit rows, 0
# measures a serve level from its start or to its end.
ZERO_ALLOWED = {
    ("throughput", "--prefill-len"),
    ("throughput", "--seed"),
    ("planner", "--seed"),
    ("ttft", "--pcp-min-tokens"),
    ("prefix", "--requests"),
    ("prefix", "--seed"),
    ("serve", "--seed"),
    ("serve", "--warmup"),
    ("serve", "--cooldown"),
    ("soak", "--seed"),
    ("throughput", "--pcp-spread-min-rows"),
}


def options(bench: str) -> list[argparse.Action]:
    """The bench's options (flags), as its parser defines them."""
    parser = argparse.ArgumentParser()
    BENCHMARKS.load(bench).add_arguments(parser)
    return [a for a in parser._actions if a.option_strings]


def typed_actions(bench: str) -> list[argparse.Action]:
    """The bench's options that take an integer value (rates are fractions, tested below)."""
    return [a for a in options(bench) if a.type is not None and a.type is not fraction]


def required_args(bench: str) -> list[str]:
    """Values for the bench's required options, so that parsing reaches the option under test."""
    return [x for a in options(bench) if a.required for x in (a.option_strings[0], "x")]


def numeric_options(bench: str) -> list[tuple[str, int]]:
    """Each numeric option with how many values it takes at once (``nargs=2`` takes two)."""
    return [(a.option_strings[0], a.nargs if isinstance(a.nargs, int) else 1) for a in typed_actions(bench)]


BENCH_CASES = [
    (bench, option, value, count)
    for bench in BENCHMARKS.help
    for option, count in numeric_options(bench)
    for value in (["-1"] if (bench, option) in ZERO_ALLOWED else ["0", "-1"])
]


def test_every_bench_has_numeric_options_covered():
    assert {b for b, _, _, _ in BENCH_CASES} == set(BENCHMARKS.help)
    assert len(BENCH_CASES) >= 20
    # A bare `type=int` accepts 0 and negatives: each option must use a validating type.
    bare = [(b, a.dest) for b in BENCHMARKS.help for a in typed_actions(b) if a.type in (int, float)]
    assert not bare


@pytest.mark.parametrize("bench, option, value, count", BENCH_CASES)
def test_bench_refuses_zero_and_negative(bench, option, value, count, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", bench, *required_args(bench), option, *[value] * count])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: must be an integer " in err
    assert repr(value) in err and "Traceback" not in err


@pytest.mark.parametrize("bench, option", sorted(ZERO_ALLOWED))
def test_zero_where_it_means_something_is_accepted(bench, option):
    args = cli.build_parser().parse_args(["bench", bench, option, "0"])
    assert getattr(args, option.lstrip("-").replace("-", "_")) == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "planner", "--budget", str(1 << 30)],  # index maps of a billion tokens
        ["bench", "planner", "--repeat", "x"],
        ["bench", "throughput", "--threads", "100000"],
        ["bench", "ttft", "--lengths", "4096", "0"],  # each value of a list
        ["bench", "ttft", "--short", "16", "-4"],
        ["bench", "soak", "--abort-rate", "1.5"],  # a rate is in [0, 1]
        ["bench", "soak", "--bad-rate", "nan"],
    ],
)
def test_bench_refuses_other_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument" in err and "Traceback" not in err


def test_throughput_prompt_lengths_in_order(capsys):
    assert cli.main(["bench", "throughput", "--min-prompt-len", "100", "--max-prompt-len", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--min-prompt-len <= --max-prompt-len" in err


def assert_one_error_line(argv: list[str], words: list[str], capsys) -> None:
    """`ctxpar ARGV` exits 2 with one `error:` line naming every one of `words`."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--prompt-lens", "0"], ["--prompt-lens", "0"]),
        (["--prompt-lens", str(10**10)], ["--prompt-lens", "2147483647"]),
        (["--prompt-lens", "10", "--cached", "-1"], ["--cached", "-1"]),
        (["--decodes", "-1"], ["--decodes", "-1"]),
        (["--decodes", str(10**11)], ["--decodes", "2147483647"]),
        (["--decodes", "1", "--decode-context", "0"], ["--decode-context", "0"]),
        (["--decodes", "1", "--decode-context", str(10**19)], ["--decode-context", "2147483647"]),
        (["--prompt-lens", "10", "--pcp", "-1"], ["--pcp", "-1"]),
        (["--prompt-lens", "10", "--pcp", str(10**8)], ["--pcp", "1024"]),
        (["--prompt-lens", "100000000", "100000000"], ["token slots", "16,777,216"]),
        (["--decodes", "10000", "--pcp", "1024"], ["rows", "131,072"]),
        (["--prompt-lens", "10", "--pcp", "100", "--png", "x.png"], ["--png", "64 ranks"]),
        (["--prompt-lens", "10", "--png", "/no/such/dir/x.png"], ["--png", "/no/such/dir", "does not exist"]),
    ],
)
def test_plan_refuses_bad_and_huge_values(argv, words, capsys):
    assert_one_error_line(["plan", *argv], words, capsys)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--max-tokens", "0"], ["max_tokens", "0"]),
        (["--max-tokens", "-3"], ["max_tokens", "-3"]),
        (["--temperature", "nan"], ["temperature", "finite", "nan"]),
        (["--temperature", "inf"], ["temperature", "finite", "inf"]),
        (["--temperature", "-1"], ["temperature", "-1"]),
        (["--top-p", "0"], ["top_p", "(0, 1]"]),
        (["--top-p", "nan"], ["top_p", "nan"]),
        (["--top-k", "-2"], ["top_k", "-2"]),  # 0 and -1 both mean off, as in vLLM
        (["--min-p=-inf"], ["min_p", "-inf"]),
        (["--seed", str(1 << 64)], ["seed", "64 bits"]),
        (["--max-model-len", "1"], ["max_model_len", ">= 2"]),
        (["--max-model-len", "-1"], ["max_model_len", "-1"]),
        (["--max-num-batched-tokens", "0"], ["max_num_batched_tokens", "0"]),
        (["--block-size", "0"], ["block_size", "0"]),
        (["--kv-cache-blocks", "-1"], ["num_kv_blocks", "-1"]),
        (["--pcp", "0"], ["pcp_size", "0"]),
        (["--pcp-min-tokens", "-1"], ["pcp_min_tokens", "-1"]),
        (["--master-port", "70000"], ["master_port", "65535"]),
        (["--master-port", "0"], ["master_port", "0"]),
        (["--threads", "0"], ["num_threads", "0"]),
        (["--threads", "1000000"], ["num_threads", "1000000"]),
    ],
)
def test_generate_refuses_bad_values_before_loading(argv, words, capsys):
    assert_one_error_line(["generate", *argv], words, capsys)


def test_generate_huge_kv_cache_refused(tiny_model_dirs, capsys):
    assert cli.main(["generate", "--model", str(tiny_model_dirs["llama"]), "--kv-cache-blocks", str(10**9)]) == 2
    err = capsys.readouterr().err
    # Refused from the config (block ids vs this machine's memory) or, on a
    # machine big enough for those, from the KV size once the model's shape is known.
    assert err.startswith("error: num_kv_blocks=1000000000 ") and "memory" in err and "Traceback" not in err


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "ttft", "--repeat", "0"],
        ["plan", "--prompt-lens", "10", "--png", "/no/such/dir/x.png"],
        ["generate", "--temperature", "nan"],
    ],
)
def test_real_process_exits_2_with_one_error_line(argv):
    r = subprocess.run([sys.executable, "-m", "ctxpar.cli", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert "error: " in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr


@pytest.mark.multiprocess
def test_throughput_vs_pcp_prints_the_ratio_of_two_rank_counts(tiny_model_dirs, capsys):
    """--pcp 2 --vs-pcp 1: both setups run the same workload, alternating, and
    generate the same tokens (greedy: P=2 must equal one rank)."""
    argv = [
        "bench",
        "throughput",
        "--model",
        str(tiny_model_dirs["llama"]),
        "--pcp",
        "2",
        "--vs-pcp",
        "1",
        "--threads",
        "2",
        "--num-prompts",
        "3",
        "--min-prompt-len",
        "8",
        "--max-prompt-len",
        "40",
        "--output-len",
        "4",
        "--prefill-len",
        "64",
        "--rounds",
        "1",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.index("round 1, P=1") < out.index("round 1, P=2")
    assert "token-identical requests: 3/3" in out
    assert "throughput P=2/P=1" in out and "prefill time P=1/P=2" in out
