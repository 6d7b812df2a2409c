"""Rank 0's engine: ``Engine`` (scheduler, block manager, sampler), vLLM's
``LLMEngine`` and ``AsyncLLM`` over it, and ``EngineArgs``. Imported lazily:
``import ctxpar.engine`` loads no torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineArgs": "ctxpar.engine.arg_utils",
    "AsyncEngineArgs": "ctxpar.engine.arg_utils",
    "LLMEngine": "ctxpar.engine.llm_engine",
    "AsyncLLM": "ctxpar.engine.async_llm",
    "AsyncLLMEngine": "ctxpar.engine.async_llm",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ctxpar.engine' has no attribute {name!r}")
