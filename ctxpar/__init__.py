"""ctxpar: context-parallel LLM inference.

    from ctxpar import LLM, SamplingParams
"""

import os

# PyTorch's OpenMP runtime (libgomp) busy-waits between parallel regions by
# default. When other processes want the same cores, a spinning thread holds
# the core its peer needs to finish the region, and every one of the ~300
# regions of a decode step waits out a time slice: with a loaded machine a
# 2-thread decode step took 1.1-1.4 s spinning against 0.14-0.18 s waiting
# passively (docs/benchmarks.md, "Threads"). libgomp reads this when torch is
# first imported, so it is set before any import below; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ctxpar.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from ctxpar.config import EngineConfig
from ctxpar.errors import CtxparError, RankFailure
from ctxpar.inputs import PromptType, TextPrompt, TokensPrompt
from ctxpar.llm import LLM
from ctxpar.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ctxpar.sampling_params import SamplingParams

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
