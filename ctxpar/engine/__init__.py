"""Rank 0's engine: ``Engine`` (scheduler, block manager, sampler), vLLM's
``LLMEngine`` and ``AsyncLLM`` over it, and ``EngineArgs``. Imported lazily:
``import ctxpar.engine`` loads no torch. Each name's import is spelled out, so that
the import graph (tests/architecture/test_layering.py) sees it."""

from __future__ import annotations

from typing import Any

__all__ = ["EngineArgs", "AsyncEngineArgs", "LLMEngine", "AsyncLLM", "AsyncLLMEngine"]


def __getattr__(name: str) -> Any:
    match name:
        case "EngineArgs":
            from ctxpar.engine.arg_utils import EngineArgs

            return EngineArgs
        case "AsyncEngineArgs":
            from ctxpar.engine.arg_utils import AsyncEngineArgs

            return AsyncEngineArgs
        case "LLMEngine":
            from ctxpar.engine.llm_engine import LLMEngine

            return LLMEngine
        case "AsyncLLM":
            from ctxpar.engine.async_llm import AsyncLLM

            return AsyncLLM
        case "AsyncLLMEngine":
            from ctxpar.engine.async_llm import AsyncLLMEngine

            return AsyncLLMEngine
    raise AttributeError(f"module 'ctxpar.engine' has no attribute {name!r}")
