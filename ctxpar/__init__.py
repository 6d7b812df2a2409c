"""ctxpar: context-parallel LLM inference.

from ctxpar import LLM, SamplingParams
"""

from ctxpar.config import EngineConfig
from ctxpar.entrypoints.beam_search import BeamSearchOutput, BeamSearchSequence
from ctxpar.entrypoints.llm import LLM
from ctxpar.errors import CtxparError, RankFailure
from ctxpar.inputs import PromptType, TextPrompt, TokensPrompt
from ctxpar.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ctxpar.sampling_params import BeamSearchParams, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "TextPrompt",
    "TokensPrompt",
    "PromptType",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "EngineConfig",
    "CtxparError",
    "RankFailure",
]
__version__ = "0.1.0"
