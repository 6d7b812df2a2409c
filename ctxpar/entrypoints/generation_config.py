"""Default sampling settings from a checkpoint's ``generation_config.json``.

As vLLM's ``generation_config`` argument: "auto" (the default) takes the
model's own file, "vllm" takes none (SamplingParams' neutral defaults), and a
directory path takes the ``generation_config.json`` inside it. Of the file,
only the sampling settings vLLM maps are used, under their vLLM names;
``override_generation_config`` is applied on top.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ctxpar.errors import CtxparError
from ctxpar.sampling_params import SamplingParams

logger = logging.getLogger("ctxpar")

FILE_NAME = "generation_config.json"
# Hugging Face name -> SamplingParams name, the settings vLLM takes from the file.
SAMPLING_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def _read(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CtxparError(f"cannot read {path}: {e}; fix the file or pass generation_config='vllm'") from None
    if not isinstance(config, dict):
        raise CtxparError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def default_sampling_kwargs(
    model: str | os.PathLike | None, generation_config: str, override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The SamplingParams keyword arguments that differ from its defaults.

    model: the LLM's model path (a directory has a generation config; a .gguf
        file and the default model have none).
    Raises CtxparError for a bad ``generation_config`` value, an unreadable
    file, or values SamplingParams refuses (so they fail when the LLM is
    built, not at its first generate).
    """
    if not isinstance(generation_config, (str, os.PathLike)):
        raise CtxparError(f"generation_config must be 'auto', 'vllm' or a directory path, got {generation_config!r}")
    if override is not None and not isinstance(override, dict):
        raise CtxparError(f"override_generation_config must be a dict, got {type(override).__name__}")
    config: dict[str, Any] = {}
    if generation_config == "auto":
        if model is not None and Path(model).expanduser().is_dir():
            path = Path(model).expanduser() / FILE_NAME
            if path.is_file():
                config = _read(path)
    elif generation_config != "vllm":
        path = Path(generation_config).expanduser() / FILE_NAME
        if not path.is_file():
            raise CtxparError(
                f"generation_config={str(generation_config)!r}: no {FILE_NAME} in that directory; "
                "pass 'auto' (the model's own), 'vllm' (no defaults) or a directory holding one"
            )
        config = _read(path)
    config = {**config, **(override or {})}
    found = {SAMPLING_KEYS[k]: v for k, v in config.items() if k in SAMPLING_KEYS and v is not None}
    try:
        SamplingParams(**found)
    except (CtxparError, TypeError) as e:
        raise CtxparError(
            f"the generation config's sampling defaults {found} are not usable: {e}; "
            "pass generation_config='vllm' to ignore them"
        ) from None
    if found:
        logger.warning(
            "ctxpar: default sampling parameters come from the model's generation config (%s); "
            "pass generation_config='vllm' to use SamplingParams' own defaults",
            ", ".join(f"{k}={v!r}" for k, v in found.items()),
        )
    return found
