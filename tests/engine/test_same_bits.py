"""The guarantee (README and docs/architecture.md, "The same bits whatever else runs"): a request's
token ids, sample logprobs and prompt logprobs are the same bits alone and inside any
mix of other requests, however its prompt is chunked (``max_num_batched_tokens``),
whether its prefix came from the prefix cache, whether it was preempted and
recomputed, at any P, under DCP, and with speculative decoding, in every dtype,
weight quantization and KV-cache dtype.

Each configuration runs four target requests (greedy with logprobs and prompt
logprobs, seeded sampling, two sharing a long prefix) one at a time with the prefix
cache off: the reference. Then the same targets inside a shuffled mix of random
other prompts with random budgets, after a request that warms the cache with their
shared prefix, under a small token budget (every long prompt chunked), and compares
with ``==``. Under DCP (D > 1) the reference is the targets alone at the same D: a
query's shards merge by log-sum-exp in rank order, another summation order than one
rank's, so against D = 1 the tokens are the same (in fp32) and the logprobs within
``DCP_TOL``.
"""

from __future__ import annotations

import random

import pytest

from ctxpar import LLM, SamplingParams
from helpers.deepseek_configs import tiny_deepseek_configs
from helpers.models import save_tiny_model
from helpers.tiny_tokenizer import with_byte_tokenizer

SHARED = "You are a helpful assistant. Answer briefly and precisely, in plain words. " * 3
TARGETS = [SHARED + "What is the capital of France?", SHARED + "Name three colors.", "def fibonacci(n):", "Once upon"]
DCP_TOL = 2e-4  # nats: a logprob under DCP against one rank's (measured here: 3.2e-5)


def target_params(i: int) -> SamplingParams:
    seeded = dict(temperature=0.8, top_p=0.9, seed=11 + i) if i % 2 else dict(temperature=0)
    return SamplingParams(max_tokens=12, logprobs=2, prompt_logprobs=1, ignore_eos=True, **seeded)


def key(out) -> tuple:
    return out.outputs[0].token_ids, out.outputs[0].logprobs, out.prompt_logprobs


def alone(**config) -> list[tuple]:
    with LLM(enable_prefix_caching=False, **config) as llm:
        return [key(llm.generate([p], target_params(i), use_tqdm=False)[0]) for i, p in enumerate(TARGETS)]


def in_a_mix(seed: int, **config) -> list[tuple]:
    rng = random.Random(seed)
    words = ["cats", "rivers", "stars", "code", "tea", "maps", "rain", "light"]
    others = [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 80))) for _ in range(10)]
    prompts = TARGETS + others
    params = [target_params(i) for i in range(len(TARGETS))]
    params += [SamplingParams(max_tokens=rng.randrange(1, 20), temperature=rng.choice([0, 1.0])) for _ in others]
    order = list(range(len(prompts)))
    rng.shuffle(order)
    with LLM(max_num_batched_tokens=24, **config) as llm:
        llm.generate([SHARED + "Warm the cache."], SamplingParams(max_tokens=2), use_tqdm=False)
        outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
        if "num_kv_blocks" in config:  # a cache too small for the mix: requests were preempted, recomputed
            assert llm.engine.scheduler.num_preemptions > 0
    got = {i: key(o) for i, o in zip(order, outs)}
    return [got[i] for i in range(len(TARGETS))]


# name: (the engine's settings, [the mixes' extra settings]). The default model is
# SmolLM2's Q4_1 GGUF, its blocks kept quantized (the default configuration).
CONFIGS = {
    "gguf": (
        {},
        [
            {},
            {"pcp_size": 2, "pcp_min_tokens": 8},
            {"pcp_size": 3, "pcp_min_tokens": 8},
            {"num_kv_blocks": 16, "max_model_len": 256},  # preemption: 256 tokens of KV for the whole mix
        ],
    ),
    "gguf-spec": ({}, [{"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}]),
    "gguf-int8-kv": ({"kv_cache_dtype": "int8"}, [{"pcp_size": 2, "pcp_min_tokens": 8}]),
    "fp32": ({"quantization": "none"}, [{}, {"pcp_size": 2, "pcp_min_tokens": 8}]),
    "bf16": ({"quantization": "none", "dtype": "bfloat16"}, [{}]),
    "int8-weights": ({"quantization": "int8"}, [{}]),
    "gguf-dcp": ({"pcp_size": 2, "dcp_size": 2, "pcp_min_tokens": 8}, [{}]),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CONFIGS))
def test_alone_equals_in_any_mix(name: str) -> None:
    base, mixes = CONFIGS[name]
    want = alone(**base)
    for seed, extra in enumerate(mixes):
        got = in_a_mix(seed, **base, **extra)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"{name} {extra}: target {i}"


@pytest.mark.multiprocess
def test_dcp_in_fp32_keeps_its_bits_and_one_ranks_tokens() -> None:
    """D = 2 with fp32 weights: alone and in a mix, ==; against D = 1 the shards merge in
    another order, so the logprobs within DCP_TOL and the same tokens. With quantized
    weights the int8 activations can turn that rounding into a step of a block: tokens
    may part from one rank's where the top two are that close (docs/architecture.md,
    "The same bits whatever else runs")."""
    dcp = dict(quantization="none", pcp_size=2, dcp_size=2, pcp_min_tokens=8)
    got = alone(**dcp)
    assert in_a_mix(0, **dcp) == got
    want = alone(quantization="none")
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0], f"target {i}"
        for a, b in zip(g[1], w[1]):
            worst = max(worst, *(abs(a[t].logprob - b[t].logprob) for t in a))
    assert worst < DCP_TOL, worst


@pytest.mark.multiprocess
def test_deepseek_mla_and_moe_alone_equal_in_any_mix(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tiny DeepSeek-V3 (MLA attention, routed experts) with a byte tokenizer: its
    projections, per-head up-projections, router and experts go through the panel
    kernel, so an expert's rows, a step's rows and the shards under DCP leave a
    token's bits alone, at P = 1, 2 and D = 2."""
    root = tmp_path_factory.mktemp("deepseek")
    model = str(with_byte_tokenizer(save_tiny_model(tiny_deepseek_configs()["v3"], root / "v3"), root / "v3b"))
    for base in ({}, {"pcp_size": 2, "dcp_size": 2, "pcp_min_tokens": 8}):
        want = alone(model=model, **base)
        mixes = [{}, {"pcp_size": 2, "pcp_min_tokens": 8}] if not base else [{}]
        for seed, extra in enumerate(mixes):
            got = in_a_mix(seed, model=model, **base, **extra)
            for i, (g, w) in enumerate(zip(got, want)):
                assert g == w, f"{base} {extra}: target {i}"
