"""ctxpar: context-parallel LLM inference.

from ctxpar import LLM, SamplingParams
"""

from typing import Any

from ctxpar.config import EngineConfig
from ctxpar.engine.arg_utils import AsyncEngineArgs, EngineArgs
from ctxpar.entrypoints.beam_search import BeamSearchOutput, BeamSearchSequence
from ctxpar.entrypoints.llm import LLM
from ctxpar.errors import CtxparError, RankFailure
from ctxpar.inputs import PromptType, TextPrompt, TokensPrompt
from ctxpar.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ctxpar.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "RequestMetrics",
    "TextPrompt",
    "TokensPrompt",
    "PromptType",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "EngineConfig",
    "EngineArgs",
    "AsyncEngineArgs",
    "LLMEngine",
    "AsyncLLM",
    "AsyncLLMEngine",
    "CtxparError",
    "RankFailure",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The engines import torch: loaded on first use, so `import ctxpar` (and `ctxpar --help`) stays light.
    if name in ("LLMEngine", "AsyncLLM", "AsyncLLMEngine"):
        import ctxpar.engine

        return getattr(ctxpar.engine, name)
    raise AttributeError(f"module 'ctxpar' has no attribute {name!r}")
