"""One engine's run of the fixed `ctxpar bench compare` workload, in its own process.

Run as a script by any Python: ``python compare_workload.py ENGINE SPEC_JSON``
with ENGINE "ctxpar" (one rank), "ctxpar-pN" (N prefill context-parallel ranks
on this machine's cores), "vllm" or "llama.cpp". It imports nothing from ctxpar at
module level, so the peer's Python (the peer's own venv) runs the very same
file and code. It prints one JSON line: load seconds, the figures, and the
generated token ids.

Every figure is the best of ``repeat`` runs (the least disturbed one):
- ttft_<n>: one-token generation of an n-token prompt (prefill + first token);
  where n is also a decode_after length, the decode runs' first tokens instead,
  timed from the request's submission (a long prompt is then prefilled R times,
  not 2R: at 16K on an 8B shape a prefill takes minutes)
- decode_<n>: ms per token after an n-token prompt: the engine is stepped by
  hand and the clock runs from the first token's arrival to the (1 + K)-th's,
  so the prefill (whose run-to-run noise, ~0.3 s at 2K, would swamp K decode
  steps if two generate calls were subtracted) is outside it
- batch: output tokens per second of the batch prompts x max_tokens, all at once
  (llama-cpp-python runs one sequence at a time: its prompts go one by one)
- ppl_<text>: perplexity of each text of ``spec["perplexity"]`` (token ids),
  exp of the mean negative log-likelihood of tokens 1..n-1 given those before
  (ctxpar: prompt_logprobs; llama.cpp: its logits of every position); with
  ``spec["quantization"]`` ctxpar also gives ppl_<text>_dequantized, the same
  file dequantized to fp32 (the quantization gap)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _engine(name: str, spec: dict):
    """(generate(prompts, max_tokens) -> list of token id lists,
    decode(prompt, K) -> Decoded, seconds to load)."""
    t0 = time.perf_counter()
    if name == "llama.cpp":
        return _llama_cpp(spec, t0)
    llm, sampling_params, add, step = _ctxpar(name, spec) if name.startswith("ctxpar") else _vllm(spec)
    loaded = time.perf_counter() - t0

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def decode(prompt: list[int], k: int) -> Decoded:
        sent = time.perf_counter()
        add(
            f"decode-{time.perf_counter_ns()}",
            prompt,
            sampling_params(max_tokens=1 + k, temperature=0.0, ignore_eos=True),
        )
        first, tokens = step_until(step, 1 + k)
        return first - sent, time.perf_counter() - first, tokens

    return generate, decode, loaded


def step_until(step: Callable[[], Any], n: int) -> tuple[float, list[int]]:
    """Step an engine that holds one request until it has ``n`` tokens: when its first
    token appeared (time.perf_counter) and its token ids. Decode timed from that first
    token to the last holds no prefill's noise."""
    first: float | None = None
    tokens: list[int] = []
    while len(tokens) < n:
        for out in step():
            tokens = list(out.outputs[0].token_ids)
        if first is None and tokens:
            first = time.perf_counter()
    assert first is not None  # the loop ran until tokens came
    return first, tokens


# One decode run: (seconds to the first token, seconds for tokens 2..1+K, the token ids).
Decoded = tuple[float, float, list[int]]

# An offline engine of vLLM's API: the LLM, its SamplingParams class, add(request_id, prompt
# token ids, params) and step() -> the outputs of one engine step.
OfflineEngine = tuple[Any, Any, Callable[[str, list[int], Any], object], Callable[[], list[Any]]]


def _ctxpar(name: str, spec: dict) -> OfflineEngine:
    from ctxpar import LLM, SamplingParams
    from ctxpar.config import EngineConfig

    block = EngineConfig.block_size  # the engine's default, which a cache in blocks is counted in
    llm = LLM(
        model=spec["model"],
        enable_prefix_caching=False,
        max_model_len=spec["max_model_len"],
        dtype=spec.get("dtype", "float32"),
        quantization=spec.get("quantization"),
        pcp_size=int(name.partition("-p")[2] or 1),
        # A cache of one request of max_model_len, where the workload runs one at a time (bench sizes).
        num_kv_blocks=-(-spec["max_model_len"] // block) if spec.get("kv_cache_fits_one") else None,
    )
    engine = llm.engine
    assert engine is not None  # just made
    add = lambda rid, ids, params: engine.add_request(ids, params, request_id=rid)
    return llm, SamplingParams, add, engine.step


def _vllm(spec: dict) -> OfflineEngine:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=spec["max_model_len"],
        seed=0,
    )
    engine = llm.llm_engine
    add = lambda rid, ids, params: engine.add_request(rid, {"prompt_token_ids": ids}, params)
    return llm, SamplingParams, add, engine.step


def _llama_cpp(spec: dict, t0: float):
    """_engine for llama-cpp-python: greedy, one sequence at a time, every core."""
    from llama_cpp import Llama

    threads = os.cpu_count() or 1
    llm = Llama(
        model_path=spec["model"], n_ctx=spec["max_model_len"], n_threads=threads, n_threads_batch=threads, verbose=False
    )
    loaded = time.perf_counter() - t0

    def tokens(prompt: list[int], n: int, arrivals: list[float]) -> list[int]:
        llm.reset()  # no prefix reuse between runs: each prompt is prefilled whole
        out: list[int] = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            arrivals.append(time.perf_counter())
            out.append(int(token))
            if len(out) == n:  # ignore_eos: only the count stops it
                return out
        return out

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [tokens(p, max_tokens, []) for p in prompts]

    def decode(prompt: list[int], k: int) -> Decoded:
        arrivals: list[float] = []
        sent = time.perf_counter()
        out = tokens(prompt, 1 + k, arrivals)
        return arrivals[0] - sent, time.perf_counter() - arrivals[0], out

    return generate, decode, loaded


def perplexity(name: str, spec: dict, ids: list[int], quantization: str | None) -> float:
    """exp(mean NLL) of ids[1:] given the tokens before each (see the module's docstring)."""
    if name == "llama.cpp":
        import numpy as np
        from llama_cpp import Llama

        threads = os.cpu_count() or 1
        llm = Llama(model_path=spec["model"], n_ctx=len(ids), n_threads=threads, logits_all=True, verbose=False)
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # (n-1, vocab): row t predicts ids[t+1]
        top = logits.max(axis=1)
        lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        nll = lse - logits[np.arange(len(ids) - 1), ids[1:]]
        return float(math.exp(nll.mean()))
    from ctxpar import LLM
    from ctxpar.bench.perplexity import prompt_perplexity

    with LLM(model=spec["model"], dtype="float32", quantization=quantization, max_model_len=len(ids) + 1) as llm:
        return prompt_perplexity(llm, ids)


def _timed(fn: Callable[[], T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def _peak_rss() -> int:
    """This process's peak resident memory, bytes (Linux reports kB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(name: str, spec: dict) -> dict:
    generate, decode, loaded = _engine(name, spec)
    if spec.get("load_only"):  # a cold start's load time and memory, nothing run
        return {"engine": name, "load_s": loaded, "peak_rss": _peak_rss(), "figures": {}, "tokens": {}}
    prompts = {int(k): v for k, v in spec["prompts"].items()}
    K, R = spec["decode_tokens"], spec["repeat"]
    generate([prompts[min(prompts)]], 2)  # warm-up: first-call allocations, lazy imports
    figures: dict[str, float] = {}
    tokens: dict[str, list] = {}
    for n in spec["decode_after"]:
        runs = [decode(prompts[n], K) for _ in range(R)]
        figures[f"decode_{n}"] = min(dt for _, dt, _ in runs) / K * 1e3
        tokens[f"decode_{n}"] = [runs[-1][2]]
        if n in spec["ttft"]:
            figures[f"ttft_{n}"] = min(first for first, _, _ in runs)
    for n in spec["ttft"]:
        if f"ttft_{n}" not in figures:
            figures[f"ttft_{n}"] = min(_timed(lambda: generate([prompts[n]], 1))[0] for _ in range(R))
    batch = spec.get("batch_prompts")
    if batch:
        best = float("inf")
        for _ in range(R):
            dt, out = _timed(lambda: generate(batch, spec["batch_max_tokens"]))
            best = min(best, dt)
        figures["batch"] = len(batch) * spec["batch_max_tokens"] / best
        tokens["batch"] = out
    for text, ids in spec.get("perplexity", {}).items() if name in ("ctxpar", "llama.cpp") else ():
        figures[f"ppl_{text}"] = perplexity(name, spec, ids, spec.get("quantization"))
        if name == "ctxpar" and spec.get("quantization"):
            figures[f"ppl_{text}_dequantized"] = perplexity(name, spec, ids, "none")
    return {"engine": name, "load_s": loaded, "peak_rss": _peak_rss(), "figures": figures, "tokens": tokens}


if __name__ == "__main__":
    result = run(sys.argv[1], json.loads(open(sys.argv[2]).read()))
    print("COMPARE_RESULT " + json.dumps(result), flush=True)
