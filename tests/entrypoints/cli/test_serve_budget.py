"""`ctxpar serve` runs its engine under a serving token budget (fewer tokens a step than
offline, so that streams' next tokens never wait long behind other users' prompts);
`ctxpar generate` and the Python API keep EngineConfig's offline default; a flag given
on the command line wins over both, and each command's --help states its own default."""

from __future__ import annotations

import dataclasses

from ctxpar import cli
from ctxpar.config import EngineConfig
from ctxpar.engine.arg_utils import EngineArgs
from ctxpar.entrypoints.cli.serve import SERVE_MAX_NUM_BATCHED_TOKENS

OFFLINE = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_num_batched_tokens")


def budget(argv: list[str]) -> int:
    """The engine's max_num_batched_tokens that `ctxpar ARGV` would start with."""
    args = cli.build_parser(argv).parse_args(argv)
    return EngineArgs.from_cli_args(args).create_engine_config().max_num_batched_tokens


def test_serve_defaults_to_the_serving_budget_and_offline_keeps_its_own() -> None:
    assert SERVE_MAX_NUM_BATCHED_TOKENS < OFFLINE
    assert budget(["serve"]) == SERVE_MAX_NUM_BATCHED_TOKENS
    assert budget(["generate"]) == OFFLINE
    assert EngineArgs().create_engine_config().max_num_batched_tokens == OFFLINE  # LLM(), AsyncLLM


def test_the_flag_wins_over_the_serving_default() -> None:
    assert budget(["serve", "--max-num-batched-tokens", "4096"]) == 4096
    assert budget(["generate", "--max-num-batched-tokens", "256"]) == 256


def test_each_commands_help_states_its_own_default() -> None:
    def help_of(command: str) -> str:
        parser = cli.build_parser([command])
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        action = next(a for a in sub._actions if a.dest == "max_num_batched_tokens")
        return action.help

    assert f"(default: {SERVE_MAX_NUM_BATCHED_TOKENS})" in help_of("serve")
    assert f"(default: {OFFLINE})" in help_of("generate")
