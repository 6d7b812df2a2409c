"""Exactness at long contexts: P ranks (and D = P) against one rank at 32K tokens.

A random model of SmolLM2-135M's shapes (hidden 576, 9 query and 3 KV heads of 64,
MLP 1536, vocabulary 49152) with ``--layers`` layers is built with transformers,
and its rope stretched past SmolLM2's trained 8192 tokens with ``hf_overrides``
(yarn). One prompt of ``--context`` tokens is prefilled in chunks, then
``--new-tokens`` are decoded greedily, with logprobs; every configuration must
produce the one-rank tokens, with logprobs within ``--tol``. The time to first token
of each is printed too (one prompt, chunked: a split chunk per step).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from ctxpar.checks import fraction, positive_int
from ctxpar.errors import CtxparError

SMOLLM2_SHAPES: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TRAINED = 8192


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--context", type=positive_int, default=32768, metavar="N", help="prompt + output tokens (32768)")
    p.add_argument("--layers", type=positive_int, default=2, metavar="N", help="layers of the random model (2)")
    p.add_argument("--pcp", type=positive_int, nargs="+", default=[2, 3], metavar="P", help="rank counts (2 3)")
    p.add_argument("--new-tokens", type=positive_int, default=8, metavar="N", help="greedy tokens decoded (8)")
    p.add_argument("--chunk", type=positive_int, default=4096, metavar="N", help="max_num_batched_tokens (4096)")
    p.add_argument("--tol", type=fraction, default=1e-4, metavar="X", help="largest logprob difference allowed")


def save_smollm2_shaped(d: Path, layers: int) -> Path:
    """A random model of SmolLM2-135M's shapes with ``layers`` layers, saved in ``d``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_SHAPES, num_hidden_layers=layers, bos_token_id=None, eos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(d)
    return d


def run(args: argparse.Namespace) -> None:
    import numpy as np

    from ctxpar import LLM, SamplingParams
    from ctxpar.bench.machine_line import describe_machine

    if args.context <= args.new_tokens:
        raise CtxparError("--context must exceed --new-tokens")
    print(describe_machine(), flush=True)
    factor = max(1.0, args.context / TRAINED)
    overrides = {"rope_scaling": {"rope_type": "yarn", "factor": factor}}
    prompt = np.random.default_rng(0).integers(0, SMOLLM2_SHAPES["vocab_size"], args.context - args.new_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=0)
    configs = [(1, 1)] + [(p, 1) for p in args.pcp] + [(p, p) for p in args.pcp]
    print(
        f"{args.layers}-layer model of SmolLM2's shapes, yarn x{factor:g}; "
        f"{args.context} tokens, chunks of {args.chunk}"
    )
    print(" P | D | TTFT (s) | same tokens | max |logprob - P=1|")
    with tempfile.TemporaryDirectory(prefix="ctxpar-long-") as tmp:
        model = str(save_smollm2_shaped(Path(tmp), args.layers))
        first = None
        for pcp, dcp in configs:
            kv_bytes = 2 * args.layers * 2 * 3 * 64 * 4 * (args.context + 1024) // dcp  # K and V, fp32, + slack
            with LLM(
                model,
                hf_overrides=overrides,
                max_model_len=args.context,
                pcp_size=pcp,
                dcp_size=dcp,
                pcp_min_tokens=0,
                enable_prefix_caching=False,
                max_num_batched_tokens=args.chunk,
                kv_cache_bytes=kv_bytes,
            ) as llm:
                t0 = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": prompt.tolist()}], params, use_tqdm=False)[0]
            m, c = out.metrics, out.outputs[0]
            assert m.first_token_time is not None  # it produced tokens
            ttft = m.first_token_time - (m.arrival_time or t0)
            first = first or c
            assert first.logprobs is not None and c.logprobs is not None  # params ask for them
            diff = max(abs(a[t].logprob - b[t].logprob) for a, b in zip(first.logprobs, c.logprobs) for t in a)
            same = c.token_ids == first.token_ids
            ok = same and diff <= args.tol
            print(
                f"{pcp:>2} | {dcp} | {ttft:>8.1f} | {'yes' if same else 'NO':>11} | {diff:.2e}{'' if ok else '  FAIL'}"
            )
