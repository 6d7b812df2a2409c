"""JSON schemas for the structured-output tests, and the check that an output satisfies one.

The check is the `jsonschema` package's validator (nobody here wrote it), so a
grammar that lets an invalid output through fails the tests.
"""

from __future__ import annotations

import json

import jsonschema

# Each covers a feature the grammar must compile: nested objects, arrays with
# min/max items, enums, bounded numbers, optional fields, $ref.
SCHEMAS: dict[str, dict] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 16},
                    "email": {"type": "string", "maxLength": 24},
                },
                "required": ["name"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum_number": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["color", "score"],
    },
    "optional": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "notes": {"type": "string", "maxLength": 10},
        },
        "required": ["title"],
    },
    "ref": {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
    },
}


def check_json(text: str, schema: dict) -> None:
    """Raise unless ``text`` is JSON that validates against ``schema``."""
    jsonschema.validate(json.loads(text), schema)
