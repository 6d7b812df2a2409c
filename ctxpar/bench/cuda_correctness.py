"""``ctxpar bench cuda`` part 1: ctxpar against transformers on the same weights
on the same device, and against ctxpar on the CPU (ctxpar/bench/cuda.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from ctxpar.bench.cuda_models import correctness_configs, guarded, transformers_greedy
from ctxpar.models.random_checkpoint import save_random_model

MODELS = ("smollm2", "qwen3", "deepseek-v3")  # correctness_configs' names
TIE = 0.05  # a top-2 logit gap under this is a near-tie: two correct engines may pick either token


def hf_reference(model, prompts: list[list[int]], max_new: int, device) -> list[dict]:
    """Per prompt: transformers' prompt logprobs (n-1,), its greedy tokens and their logits."""
    import torch

    refs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            full = model(x).logits[0].float()  # (n, vocab)
            lp = torch.log_softmax(full[:-1], -1).gather(1, x[0, 1:, None])[:, 0].cpu()
            tokens, logits = transformers_greedy(model, ids, max_new, device)
            refs.append({"prompt_lp": lp, "tokens": tokens, "logits": logits.cpu()})
    return refs


def agreement(got: list[int], want: list[int], ref_logits) -> tuple[int, str]:
    """Leading tokens equal, and how the first difference reads: at a near-tie or not."""
    for k, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top = ref_logits[k].topk(2)
            gap = float(top.values[0] - top.values[1])
            return k, f"differs at {k} (top-2 gap {gap:.3g}: {'near-tie' if gap < TIE else 'NOT a near-tie'})"
    return len(want), "all equal"


def run_ctxpar(model_dir: str, prompts: list[list[int]], max_new: int, device: str, kwargs: dict) -> dict:
    """The batch through LLM (prompt logprobs, greedy tokens and their logprobs), then a prefix-cache
    hit: the longest prompt's leading blocks and a new tail."""
    from ctxpar import LLM, SamplingParams

    longest = max(prompts, key=len)
    with LLM(model_dir, device=device, max_num_batched_tokens=256, max_model_len=2048, **kwargs) as llm:
        params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        plain = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, logprobs=0)
        llm.generate([{"prompt_token_ids": longest}], plain, use_tqdm=False)  # its blocks enter the cache
        hit_prompt = hit_prompt_of(prompts)
        hit = llm.generate([{"prompt_token_ids": hit_prompt}], plain, use_tqdm=False)[0]
    res: dict = {"rows": []}
    for p, o in zip(prompts, outs):
        assert o.prompt_logprobs is not None
        lp = [o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]  # type: ignore[index]
        c = o.outputs[0]
        res["rows"].append(
            {
                "prompt_lp": np.array(lp),
                "tokens": c.token_ids,
                "lp": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])],
            }
        )
    c = hit.outputs[0]
    res["hit"] = {
        "prompt": hit_prompt,
        "cached": hit.num_cached_tokens,
        "tokens": c.token_ids,
        "lp": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])],
    }
    return res


def compare(run: dict, refs: list[dict], hit_ref: dict) -> dict:
    """Figures of one ctxpar run against transformers' references."""
    lp_diff, tok_agree, tok_total, notes, gen_diff = 0.0, 0, 0, [], 0.0
    for row, ref in zip(run["rows"], refs):
        lp_diff = max(lp_diff, float(np.abs(row["prompt_lp"] - ref["prompt_lp"].numpy()).max()))
        k, note = agreement(row["tokens"], ref["tokens"], ref["logits"])
        tok_agree, tok_total = tok_agree + k, tok_total + len(ref["tokens"])
        notes.append(note)
        ref_lp = torch_log_softmax_at(ref["logits"][:k], ref["tokens"][:k])
        if k:
            gen_diff = max(gen_diff, float(np.abs(np.array(row["lp"][:k]) - ref_lp).max()))
    h = run["hit"]
    hk, hnote = agreement(h["tokens"], hit_ref["tokens"], hit_ref["logits"])
    return {
        "prompt_logprob_max_abs_diff": lp_diff,
        "greedy_tokens_agreeing": f"{tok_agree}/{tok_total}",
        "greedy_notes": notes,
        "sampled_logprob_max_abs_diff": gen_diff,
        "prefix_hit_cached_tokens": h["cached"],
        "prefix_hit_tokens_agreeing": f"{hk}/{len(hit_ref['tokens'])} ({hnote})",
    }


def torch_log_softmax_at(logits, tokens: list[int]) -> np.ndarray:
    import torch

    if not tokens:
        return np.zeros(0)
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()


def between_runs(a: dict, b: dict) -> dict:
    """Two ctxpar runs (the device's and the CPU's) against each other."""
    lp = max(float(np.abs(x["prompt_lp"] - y["prompt_lp"]).max()) for x, y in zip(a["rows"], b["rows"]))
    same = sum(x["tokens"] == y["tokens"] for x, y in zip(a["rows"], b["rows"]))
    return {"prompt_logprob_max_abs_diff": lp, "rows_with_equal_tokens": f"{same}/{len(a['rows'])}"}


def hit_prompt_of(prompts: list[list[int]]) -> list[int]:
    """The prefix-cache probe: the longest prompt's whole blocks (16 tokens each), then a new tail."""
    longest = max(prompts, key=len)
    return longest[: len(longest) // 16 * 16] + [(t * 7 + 3) % 97 for t in range(40)]


def correctness(args: argparse.Namespace, device, tmp: Path, failures: dict[str, str]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    results: dict = {}
    rng = np.random.default_rng(0)
    for name, config in correctness_configs(args.layers).items():
        if name not in args.models:
            continue
        path = save_random_model(config, tmp / name, seed=1)
        prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in args.prompt_lens]
        dtypes = ["float32"] if name == "deepseek-v3" else ["float32", "bfloat16"]
        cpu_runs: dict[str, dict | None] = {}
        for dtype in dtypes:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
            refs = hf_reference(hf, prompts, args.max_new, device)
            hit_ref = hf_reference(hf, [hit_prompt_of(prompts)], args.max_new, device)[0]
            del hf
            for kv in ("auto", "int8", "fp8") if name != "qwen3" or dtype == "float32" else ("auto",):
                key = f"{name} {dtype} kv={kv}"
                t0 = time.perf_counter()
                kwargs = dict(dtype=dtype, kv_cache_dtype=kv)
                run = guarded(failures, key, lambda: run_ctxpar(str(path), prompts, args.max_new, device.type, kwargs))
                if run is None:
                    continue
                row = compare(run, refs, hit_ref)
                row["seconds"] = round(time.perf_counter() - t0, 2)
                cpu_too = dtype == "float32" and (kv == "auto" or name == "smollm2")
                if cpu_too and device.type != "cpu":
                    if kv not in cpu_runs:
                        cpu_runs[kv] = guarded(
                            failures,
                            f"{key} on the CPU",
                            lambda: run_ctxpar(str(path), prompts, args.max_new, "cpu", kwargs),
                        )
                    cpu = cpu_runs[kv]
                    if cpu is not None:
                        row["vs_ctxpar_cpu"] = between_runs(run, cpu)
                results[key] = row
                print(f"{key}: {_summary(row)}", flush=True)
    return results


def _summary(row: dict) -> str:
    cpu = row.get("vs_ctxpar_cpu")
    return (
        f"prompt logprobs max |diff| {row['prompt_logprob_max_abs_diff']:.2e}, greedy {row['greedy_tokens_agreeing']}, "
        f"prefix hit {row['prefix_hit_cached_tokens']} cached, {row['prefix_hit_tokens_agreeing']}"
        + "".join(f"; {note}" for note in row["greedy_notes"] if note != "all equal")
        + (
            f"; vs ctxpar CPU {cpu['prompt_logprob_max_abs_diff']:.2e}, rows equal {cpu['rows_with_equal_tokens']}"
            if cpu
            else ""
        )
    )
