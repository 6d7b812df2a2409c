"""EngineArgs: the engine's arguments as vLLM spells them, one definition for
the Python API (``LLMEngine.from_engine_args``, ``AsyncLLM``, ``LLM``) and the
command line (``add_cli_args`` / ``from_cli_args``).

Its fields are EngineConfig's, derived from it (same names, same defaults: a
field added there is one here and a flag of every command that takes engine
flags), then the LLM's own (tokenizer, skip_tokenizer_init, trust_remote_code,
generation_config, override_generation_config). vLLM's other arguments are
accepted by name and kept in ``vllm_args``: ignored with a log line where they
only tune speed or memory, refused where they would change the outputs
(ctxpar/engine/vllm_args.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ctxpar.config import EngineConfig
from ctxpar.engine.vllm_args import HINTS, REFUSED, apply_vllm_args
from ctxpar.errors import CtxparError
from ctxpar.knobs import add_flags

CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))

if TYPE_CHECKING:

    class _ConfigFields:
        """To a type checker, EngineConfig's fields on EngineArgs are attributes of any type:
        they are made at import (below), not written out, so that none is restated here."""

        def __getattr__(self, name: str) -> Any: ...
        def __setattr__(self, name: str, value: Any) -> None: ...

else:

    def _config_fields() -> type:
        """EngineConfig's fields, unvalidated and mutable (as vLLM's EngineArgs are), each
        with its default and flag: the first fields of EngineArgs, in EngineConfig's order."""
        hints = typing.get_type_hints(EngineConfig)
        return dataclasses.make_dataclass(
            "_ConfigFields",
            [
                (f.name, hints[f.name], field(default=f.default, metadata=f.metadata))
                for f in dataclasses.fields(EngineConfig)
            ],
            namespace={"__module__": __name__},
        )

    _ConfigFields = _config_fields()


@dataclass(init=False)
class EngineArgs(_ConfigFields):
    """``EngineArgs(model=..., pcp_size=2, gpu_memory_utilization=0.9, ...)``: every
    EngineConfig field (inherited, with EngineConfig's defaults), then LLM's own."""

    # The tokenizer and sampling defaults (LLM's own arguments).
    tokenizer: str | None = None  # a Hugging Face tokenizer directory instead of the model's
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs have no text
    trust_remote_code: bool = False  # lets `tokenizer` run its own code
    generation_config: str = "auto"  # where LLM's default sampling params come from
    override_generation_config: dict[str, Any] | None = None
    vllm_args: dict[str, Any] = field(default_factory=dict)  # vLLM's other arguments, by name

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, default)
        self.model = model
        self.vllm_args = dict(kwargs.pop("vllm_args", None) or {})  # as dataclasses.asdict() gives them back
        own = {f.name for f in dataclasses.fields(self)}
        for name, value in kwargs.items():
            if name in own:
                setattr(self, name, value)
            elif name in HINTS or name in REFUSED:
                self.vllm_args[name] = value
            else:
                valid = sorted(own - {"vllm_args"})
                raise CtxparError(f"unknown engine argument {name!r}; valid ones: {', '.join(valid)}")
        for name, flag in (
            ("skip_tokenizer_init", self.skip_tokenizer_init),
            ("trust_remote_code", self.trust_remote_code),
        ):
            if not isinstance(flag, bool):
                raise CtxparError(f"{name} must be True or False, got {flag!r}")

    def create_engine_config(self) -> EngineConfig:
        """The validated EngineConfig; vLLM's arguments are checked (logged or refused) here."""
        apply_vllm_args(self.vllm_args)
        return EngineConfig(**{name: getattr(self, name) for name in CONFIG_FIELDS})

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser,
        exclude: frozenset[str] = frozenset(),
        defaults: Mapping[str, Any] | None = None,
    ) -> argparse.ArgumentParser:
        """One flag per EngineConfig field, named after it (num_threads: --num-threads), with
        EngineConfig's default and the help, metavar, aliases and choices of its ``knob``
        (ctxpar/config.py). ``exclude``: fields whose flag name the command uses for something
        else (generate's --seed is the request's); they keep their default. ``defaults``: the
        command's own defaults of some fields (serve's token budget), in place of EngineConfig's."""
        fields = add_flags(parser.add_argument_group("engine"), EngineConfig, exclude, defaults)
        parser.set_defaults(engine_fields=tuple(fields))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of the flags ``add_cli_args`` added."""
        return cls(**{name: getattr(args, name) for name in args.engine_fields})


@dataclass(init=False)
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the arguments of the async engine: the same ones."""
