"""Every knob written once (issue 40): each EngineConfig field carries its flag, and
EngineArgs and the engine flags of `ctxpar generate` and `ctxpar serve` are derived
from the fields, so none can be missing, spelled twice or default differently."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from dataclasses import dataclass

import pytest

from ctxpar import LLM, AsyncEngineArgs, EngineArgs
from ctxpar.config import EngineConfig, kv_cache_dtype_for
from ctxpar.engine.vllm_args import HINTS, REFUSED
from ctxpar.entrypoints.cli import generate, serve
from ctxpar.knobs import FLAG, add_flags, knob, knobs

CONFIG = {f.name: f for f in dataclasses.fields(EngineConfig)}
# Commands that take the engine flags, and the fields whose flag name each uses for its own.
COMMANDS = {"generate": (generate, {"seed"}), "serve": (serve, set())}
# The defaults a command states for itself: serve's stall-free token budget.
COMMAND_DEFAULTS = {"generate": {}, "serve": {"max_num_batched_tokens": serve.SERVE_MAX_NUM_BATCHED_TOKENS}}


def flag_name(field: str) -> str:
    return f"--{field.replace('_', '-')}"


def test_every_config_field_is_a_knob_with_help():
    assert [f.name for f in knobs(EngineConfig)] == list(CONFIG)
    for f in CONFIG.values():
        assert f.metadata[FLAG].help.strip(), f"{f.name} has no help"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_config_field_has_a_flag_with_its_default(command):
    module, own = COMMANDS[command]
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    actions = parser._option_string_actions
    defaults = parser.parse_args([])
    built = EngineConfig()  # validation keeps every default as it is, but kv_cache_dtype's "auto" resolved
    assert built.kv_cache_dtype == kv_cache_dtype_for("auto", built.dtype, built.weight_quantization) != "auto"
    assert set(defaults.engine_fields) == set(CONFIG) - own
    own_defaults = COMMAND_DEFAULTS[command]
    for name in defaults.engine_fields:
        field, action = CONFIG[name], actions[flag_name(name)]
        assert action.dest == name
        assert action.default == own_defaults.get(name, field.default) == getattr(defaults, name), name
        if name not in own_defaults and name != "kv_cache_dtype":
            assert getattr(built, name) == field.default, name
        for alias in field.metadata[FLAG].aliases:
            assert actions[alias].dest == name, f"{alias} is not a spelling of {name}"
    # A field whose flag name the command uses for its own (generate's --seed: the request's)
    # keeps EngineConfig's default.
    assert EngineArgs.from_cli_args(defaults) == EngineArgs(**own_defaults)


def test_engine_args_fields_are_the_configs_and_the_llms_own():
    """EngineArgs holds EngineConfig's fields, with their defaults, then only LLM's own
    arguments: an engine setting that is not an EngineConfig field has nowhere to hide."""
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert list(fields)[: len(CONFIG)] == list(CONFIG)
    defaults = EngineArgs()
    for name, f in CONFIG.items():
        assert fields[name].default == f.default == getattr(defaults, name), name
        assert fields[name].metadata[FLAG] == f.metadata[FLAG]
    llm_own = set(inspect.signature(LLM.__init__).parameters) - {"self", "model", "seed", "kwargs"}
    assert set(fields) - set(CONFIG) == llm_own | {"vllm_args"}
    assert not set(fields) & (set(HINTS) | set(REFUSED)), "a vLLM argument ctxpar uses is no longer a hint"
    assert [f.name for f in dataclasses.fields(AsyncEngineArgs)] == list(fields)


def test_engine_args_stay_mutable_and_unvalidated():
    args = EngineArgs(block_size=0)  # refused by create_engine_config, as vLLM's EngineArgs
    args.block_size = 32
    assert args.create_engine_config().block_size == 32
    assert EngineArgs(**dataclasses.asdict(args)) == args


def test_add_flags_derives_type_help_and_spellings():
    """A knob's flag: type from its annotation (JSON text for a dict), "(default: ...)"
    appended unless the help gives it, --x/--no-x for a bool, aliases and choices."""

    @dataclass(frozen=True)
    class Knobs:
        count: int | None = knob(None, "how many", "N", aliases=("--n",))
        ratio: float = knob(0.5, "a ratio", "R")
        name: str = knob("a", "a name (default: first)", "NAME")
        table: dict[str, int] | None = knob(None, "a table", "JSON")
        mode: str = knob("x", "a mode", choices=("x", "y"))
        on: bool = knob(True, "switch", aliases=("--off",))
        plain: int = 3  # not a knob: no flag

    parser = argparse.ArgumentParser()
    assert add_flags(parser.add_argument_group("g"), Knobs, exclude=frozenset({"name"})) == [
        "count",
        "ratio",
        "table",
        "mode",
        "on",
    ]
    args = parser.parse_args(["--n", "3", "--ratio", "2", "--table", '{"a": 1}', "--mode", "y", "--off"])
    assert vars(args) == dict(count=3, ratio=2.0, table='{"a": 1}', mode="y", on=False)
    assert parser.parse_args(["--no-on"]).on is False and parser.parse_args(["--on"]).on is True
    actions = parser._option_string_actions
    assert actions["--ratio"].help == "a ratio (default: 0.5)" and actions["--count"].help == "how many"
    assert actions["--mode"].metavar is None and actions["--count"].metavar == "N"
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "z"])
