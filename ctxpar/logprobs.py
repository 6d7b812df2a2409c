"""vLLM's ``vllm.logprobs`` names, so ``from vllm.logprobs import Logprob`` ports by its import line."""

from ctxpar.outputs import Logprob, LogprobsOnePosition, PromptLogprobs, SampleLogprobs

__all__ = ["Logprob", "LogprobsOnePosition", "PromptLogprobs", "SampleLogprobs"]
