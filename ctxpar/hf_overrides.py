"""hf_overrides: changes to a checkpoint's config.json made at load time, spelled as vLLM's
(``LLM(hf_overrides={...})``, ``--hf-overrides JSON``).

Top-level keys replace the config's values. ``rope_scaling`` (vLLM's and older
transformers' name) and ``rope_parameters`` (transformers 5's) are merged into the
config's rope parameters, so ``{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}``
keeps the checkpoint's ``rope_theta``. A scaling with a factor and no explicit
``max_position_embeddings`` stretches the context the model accepts, as vLLM derives
it: ``original_max_position_embeddings`` (the checkpoint's own length when absent)
times the factor.
"""

from __future__ import annotations

import json
from typing import Any

from ctxpar.errors import CtxparError

ROPE_KEYS = ("rope_scaling", "rope_parameters")
STRETCHING = (
    "linear",
    "yarn",
)  # rope types whose factor multiplies the context length (not dynamic NTK: it depends on the sequence)


def parse_hf_overrides(value: Any) -> dict[str, Any] | None:
    """None, a dict or its JSON (the command line's) -> a dict with string keys, or None."""
    if value is None or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise CtxparError(f"hf_overrides is not valid JSON ({e}): {value!r}") from e
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise CtxparError(f"hf_overrides must be a dict of config.json keys (or its JSON), got {value!r}")
    for key in ROPE_KEYS:
        if key in value and not isinstance(value[key], dict):
            raise CtxparError(f"hf_overrides {key} must be a dict such as {{'rope_type': 'yarn', 'factor': 4.0}}")
    return dict(value)


def overridden_config_kwargs(config: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments that rebuild ``config`` with the overrides applied
    (``AutoConfig.from_pretrained(d, **kwargs)``)."""
    out = {k: v for k, v in overrides.items() if k not in ROPE_KEYS}
    rope: dict[str, Any] = {}
    for key in ROPE_KEYS:
        rope.update(overrides.get(key) or {})
    if not rope:
        return out
    if "type" in rope:  # the older spelling of rope_type
        rope.setdefault("rope_type", rope.pop("type"))
    merged = {**(getattr(config, "rope_parameters", None) or {}), **rope}
    own_len = out.get("max_position_embeddings", getattr(config, "max_position_embeddings", None))
    if merged.get("rope_type") == "yarn" and own_len is not None:
        merged.setdefault("original_max_position_embeddings", own_len)
    factor = merged.get("factor")
    if merged.get("rope_type") in STRETCHING and factor and "max_position_embeddings" not in overrides:
        base = merged.get("original_max_position_embeddings", own_len)
        if base is not None:
            out["max_position_embeddings"] = int(base * float(factor))
    out["rope_parameters"] = merged
    return out
