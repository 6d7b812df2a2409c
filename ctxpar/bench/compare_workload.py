"""One engine's run of the fixed `ctxpar bench compare` workload, in its own process.

Run as a script by any Python: ``python compare_workload.py ENGINE SPEC_JSON``
with ENGINE "ctxpar" or "vllm". It imports nothing from ctxpar at module level,
so the peer's Python (vLLM's own venv) runs the very same file and code. It
prints one JSON line: load seconds, the figures, and the generated token ids.

Every figure is the best of ``repeat`` runs (the least disturbed one):
- ttft_<n>: one-token generation of an n-token prompt (prefill + first token)
- decode_<n>: ms per token after an n-token prompt: the engine is stepped by
  hand and the clock runs from the first token's arrival to the (1 + K)-th's,
  so the prefill (whose run-to-run noise, ~0.3 s at 2K, would swamp K decode
  steps if two generate calls were subtracted) is outside it
- batch: output tokens per second of the batch prompts x max_tokens, all at once
"""

from __future__ import annotations

import json
import sys
import time


def _engine(name: str, spec: dict):
    """(generate(prompts, max_tokens) -> list of token id lists,
    decode(prompt, K) -> (seconds for tokens 2..1+K, token ids), seconds to load)."""
    t0 = time.perf_counter()
    if name == "ctxpar":
        from ctxpar import LLM, SamplingParams

        llm = LLM(
            model=spec["model"], enable_prefix_caching=False, max_model_len=spec["max_model_len"], dtype="float32"
        )
        engine = llm._engine
        add = lambda rid, ids, params: engine.add_request(ids, params, request_id=rid)
    else:
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=spec["model"],
            dtype="float32",
            enforce_eager=True,
            enable_prefix_caching=False,
            max_model_len=spec["max_model_len"],
            seed=0,
        )
        engine = llm.llm_engine
        add = lambda rid, ids, params: engine.add_request(rid, {"prompt_token_ids": ids}, params)
    loaded = time.perf_counter() - t0

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def decode(prompt: list[int], k: int) -> tuple[float, list[int]]:
        add(
            f"decode-{time.perf_counter_ns()}",
            prompt,
            SamplingParams(max_tokens=1 + k, temperature=0.0, ignore_eos=True),
        )
        first, tokens = None, []
        while len(tokens) < 1 + k:
            for out in engine.step():
                tokens = list(out.outputs[0].token_ids)
            if first is None and tokens:
                first = time.perf_counter()
        return time.perf_counter() - first, tokens

    return generate, decode, loaded


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def run(name: str, spec: dict) -> dict:
    generate, decode, loaded = _engine(name, spec)
    prompts = {int(k): v for k, v in spec["prompts"].items()}
    K, R = spec["decode_tokens"], spec["repeat"]
    generate([prompts[min(prompts)]], 2)  # warm-up: first-call allocations, lazy imports
    figures: dict[str, float] = {}
    tokens: dict[str, list] = {}
    for n in spec["ttft"]:
        figures[f"ttft_{n}"] = min(_timed(lambda: generate([prompts[n]], 1))[0] for _ in range(R))
    for n in spec["decode_after"]:
        runs = [decode(prompts[n], K) for _ in range(R)]
        figures[f"decode_{n}"] = min(dt for dt, _ in runs) / K * 1e3
        tokens[f"decode_{n}"] = [runs[-1][1]]
    batch = spec["batch_prompts"]
    best = float("inf")
    for _ in range(R):
        dt, out = _timed(lambda: generate(batch, spec["batch_max_tokens"]))
        best = min(best, dt)
    figures["batch"] = len(batch) * spec["batch_max_tokens"] / best
    tokens["batch"] = out
    return {"engine": name, "load_s": loaded, "figures": figures, "tokens": tokens}


if __name__ == "__main__":
    result = run(sys.argv[1], json.loads(open(sys.argv[2]).read()))
    print("COMPARE_RESULT " + json.dumps(result), flush=True)
