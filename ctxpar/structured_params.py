"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's class).

Exactly one kind per request: a JSON schema, a regex, a list of choices, an
EBNF grammar, any JSON object, or a structural tag. The engine turns it into a
grammar (ctxpar/engine/sample/structured_output.py) and masks, at every step, the
tokens that would leave the grammar. Importable from ``ctxpar.sampling_params``
as in vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ctxpar.errors import CtxparError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One output constraint (set exactly one of the first six fields).

    json: a JSON schema, as a dict, a JSON string or a pydantic model class;
        the output is a JSON value that validates against it.
    regex: the output fully matches this regular expression.
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (xgrammar's / llama.cpp's GBNF syntax, with a
        ``root`` rule); the output is a sentence of it.
    json_object: True: the output is any JSON object or array (OpenAI's
        ``response_format={"type": "json_object"}``).
    structural_tag: a JSON string (or dict) of xgrammar's structural tag:
        free text in which each trigger starts a tagged, schema-checked part.
    disable_any_whitespace: JSON laid out as ``json.dumps`` writes it (one
        space after ',' and ':', no other whitespace) instead of any amount of
        whitespace between tokens (no runs of newlines from a model that likes them).
    disable_additional_properties: objects hold only the properties their
        schema names. xgrammar's strict mode does this for every schema that
        leaves ``additionalProperties`` unset; True also overrides an explicit
        ``"additionalProperties": true``.
    disable_fallback: accepted for vLLM compatibility; there is one backend
        (xgrammar), so there is nothing to fall back to.
    whitespace_pattern: not supported by xgrammar; must stay None.
    """

    json: str | dict | Any | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fields' shapes (the grammar itself is checked by the engine,
        which compiles it); raises CtxparError naming the problem."""
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            have = ", ".join(given) if given else "none"
            raise CtxparError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {have}: set one constraint"
            )
        if self.json is not None:
            self.json = _schema(self.json)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise CtxparError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise CtxparError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise CtxparError(f"structured_outputs.choice must hold non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise CtxparError(f"structured_outputs.grammar must be a non-empty EBNF string, got {self.grammar!r}")
        if self.json_object is not None and self.json_object is not True:
            raise CtxparError(f"structured_outputs.json_object must be True when set, got {self.json_object!r}")
        if self.structural_tag is not None:
            self.structural_tag = _json_text("structural_tag", self.structural_tag)
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise CtxparError(f"structured_outputs.{name} must be True or False, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None:
            raise CtxparError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                "use disable_any_whitespace=True for compact JSON"
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    def key(self) -> tuple:
        """What identifies the compiled grammar: equal keys compile once."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag"):
            value = json.loads(value)  # the same schema, however it was spaced or ordered
        return (
            self.kind,
            json.dumps(value, sort_keys=True),
            self.disable_any_whitespace,
            self.disable_additional_properties,
        )


def _schema(value: Any) -> str:
    """A JSON schema given as a dict, a JSON string or a pydantic model class, as a JSON string."""
    schema_of = getattr(value, "model_json_schema", None)
    if isinstance(value, type) and callable(schema_of):
        value = schema_of()
    text = _json_text("json", value)
    if not isinstance(json.loads(text), dict):
        raise CtxparError(f"structured_outputs.json must be a JSON schema object, got {text[:80]!r}")
    return text


def _json_text(name: str, value: Any) -> str:
    """A dict or a JSON string, as a (checked) JSON string."""
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as e:
            raise CtxparError(f"structured_outputs.{name} is not JSON-serialisable: {e}") from None
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise CtxparError(f"structured_outputs.{name} is not valid JSON: {e}") from None
        return value
    raise CtxparError(
        f"structured_outputs.{name} must be a dict, a JSON string"
        + (" or a pydantic model class" if name == "json" else "")
        + f", got {type(value).__name__}"
    )
