"""Perplexity of real text through ctxpar's ``prompt_logprobs``: the quality figure of
`ctxpar bench compare --peer llama.cpp` (quantized weights) and of `ctxpar bench
quant --perplexity` (quantized KV caches).

The texts are real English prose (Python's own documentation, ``pydoc_data.topics``)
and real source code (this Python's ``argparse.py``): nobody here wrote either.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any


def perplexity_texts(tokenizer: Any, n: int) -> dict[str, list[int]]:
    """The first n token ids of real English prose and real code, by ``tokenizer``."""
    from pydoc_data.topics import topics

    texts = {"english": "\n\n".join(topics[k] for k in sorted(topics)), "code": Path(argparse.__file__).read_text()}
    return {name: tokenizer.encode(text, add_special_tokens=False)[:n] for name, text in texts.items()}


def prompt_perplexity(llm: Any, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], each given the tokens before
    it, from one ``LLM.generate`` with ``prompt_logprobs``."""
    from ctxpar import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    entries = out[0].prompt_logprobs[1:]  # the first prompt token has none
    nll = [-entry[token].logprob for entry, token in zip(entries, ids[1:])]
    return math.exp(sum(nll) / len(nll))
