"""``ctxpar bench cuda`` part 2: TTFT and decode against transformers and the
cost model, and what a decode step's kernel launches cost (ctxpar/bench/cuda.py)."""

from __future__ import annotations

import argparse
import copy
import gc
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ctxpar.bench.compare_workload import step_until
from ctxpar.bench.cuda_models import guarded, weights_from
from ctxpar.entrypoints.cli.calibrate_host import launches


def speed_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    from ctxpar.costmodel.models import BUILTIN_MODELS

    shape = dict(BUILTIN_MODELS[args.speed_model])
    if args.speed_layers is not None:
        shape["num_hidden_layers"] = args.speed_layers
    return LlamaConfig(
        **shape,
        max_position_embeddings=max(args.lengths) + args.decode_steps + 64,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_speed(hf, ids: list[int], steps: int, device):
    """transformers' TTFT (its forward, the last position's logits only, best of 2), its decode
    step, its first token and the last position's log-softmax (vocab,)."""
    import torch

    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        best = math.inf
        for _ in range(2):
            _sync(device)
            t0 = time.perf_counter()
            logits = hf(x, use_cache=False, logits_to_keep=1).logits[0, -1].float()
            first = int(logits.argmax())
            best = min(best, time.perf_counter() - t0)
        lp = torch.log_softmax(logits, -1).cpu()
        _sync(device)
        t0 = time.perf_counter()
        hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=1 + steps,
            min_new_tokens=1 + steps,
            eos_token_id=None,
            pad_token_id=0,
        )
        _sync(device)
        total = time.perf_counter() - t0
    return best, (total - best) / steps, first, lp


def ctxpar_speed(llm, ids: list[int], steps: int) -> tuple[float, float, int, float]:
    """ctxpar's TTFT (best of 2), decode step after the prompt, first token and its logprob.
    The decode step is timed from the first token to the last as the engine's steps give
    them: a difference of two whole runs' times would hold their prefills' noise (and a
    prefix-cache hit in one of them), which can outweigh a few steps."""
    from ctxpar import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=0)
    best, first, lp = math.inf, -1, math.nan
    for _ in range(2):
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)[0].outputs[0]
        dt = time.perf_counter() - t0
        if dt < best:
            best, first = dt, out.token_ids[0]
            lp = (out.logprobs or [{}])[0][first].logprob
    engine = llm.engine
    engine.add_request(ids, SamplingParams(max_tokens=1 + steps, temperature=0, ignore_eos=True), request_id="speed")
    first_at, _ = step_until(engine.step, 1 + steps)
    return best, (time.perf_counter() - first_at) / steps, first, lp


def make_speed_model(config, device):
    """transformers' model of ``config``, its random weights made on ``device`` in bf16."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return LlamaForCausalLM(copy.deepcopy(config)).eval()
    finally:
        torch.set_default_dtype(old)


def op_profile(fn: Callable[[], Any], device, path: Path) -> None:
    """torch.profiler's table of what ``fn`` spends, by operator, written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=40))


def launch_cost(device, n: int = 2000) -> dict:
    """Seconds per kernel launch: a 1-element add queued back to back, and the same
    kernels replayed from a CUDA graph (what a decode step of many small kernels costs per kernel)."""
    import torch

    x = torch.zeros(1, device=device)
    for _ in range(10):
        x.add_(1.0)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    _sync(device)
    eager = (time.perf_counter() - t0) / n
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(200):
            x.add_(1.0)
    graph.replay()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n // 200):
        graph.replay()
    _sync(device)
    return {"eager_launch_s": eager, "graph_kernel_s": (time.perf_counter() - t0) / n}


def decode_launches(llm, hf, ids: list[int], device, steps: int = 8) -> dict:
    """Kernel launches per decode step, ctxpar's and transformers' (a run of 1 + steps
    tokens less a run of 1)."""
    import torch

    from ctxpar import SamplingParams

    def ctxpar_run(k: int) -> int:
        p = SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)
        return launches(lambda: llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False), device)

    def hf_run(k: int) -> int:
        x = torch.tensor([ids], device=device)
        gen = dict(do_sample=False, max_new_tokens=k, min_new_tokens=k, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            return launches(lambda: hf.generate(x, attention_mask=torch.ones_like(x), **gen), device)

    return {
        "ctxpar_launches_per_step": (ctxpar_run(1 + steps) - ctxpar_run(1)) / steps,
        "hf_launches_per_step": (hf_run(1 + steps) - hf_run(1)) / steps,
    }


def speed(args: argparse.Namespace, device, tmp: Path, profile, failures: dict[str, str]) -> dict:
    import torch

    from ctxpar import LLM, SamplingParams
    from ctxpar.costmodel import load_model_shape
    from ctxpar.costmodel.timing import decode_time, prefill_time

    config = speed_config(args)
    config.architectures = ["LlamaForCausalLM"]
    path = tmp / "speed"
    config.save_pretrained(path)
    t0 = time.perf_counter()
    hf = make_speed_model(config, device)
    made = time.perf_counter() - t0
    print(f"speed model ({args.speed_model}, {config.num_hidden_layers} layers, bf16) made in {made:.1f} s", flush=True)
    rng = np.random.default_rng(2)
    prompts = {n: rng.integers(0, config.vocab_size, size=n).tolist() for n in sorted(args.lengths)}
    shortest, longest = min(prompts), max(prompts)
    shape = load_model_shape(str(path))
    kv_bytes = 2 * (longest + args.decode_steps + 64) * shape.kv_entries_per_token * 2 * shape.num_layers
    results: dict = {"model": args.speed_model, "layers": config.num_hidden_layers, "rows": {n: {} for n in prompts}}
    with weights_from(hf.state_dict()):
        t0 = time.perf_counter()
        llm = LLM(
            str(path),
            device=device.type,
            dtype="bfloat16",
            max_model_len=config.max_position_embeddings,
            max_num_batched_tokens=longest,
            enable_prefix_caching=False,
            kv_cache_bytes=kv_bytes,
        )
        results["ctxpar_load_s"] = time.perf_counter() - t0
    with llm:
        ctxpar_speed(llm, prompts[shortest][:512], 2)  # warm-up
        for n, ids in prompts.items():
            got = guarded(failures, f"ctxpar speed {n}", lambda: ctxpar_speed(llm, ids, args.decode_steps))
            if got is not None:
                ttft, step, first, lp = got
                results["rows"][n].update(ctxpar_ttft_s=ttft, ctxpar_decode_s=step, ctxpar_first=first, ctxpar_lp=lp)
                print(f"ctxpar {n} tokens: TTFT {ttft:.3f} s, decode {step * 1e3:.2f} ms/token", flush=True)
        if args.op_profile:
            few = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
            run_few = lambda: llm.generate([{"prompt_token_ids": prompts[shortest]}], few, use_tqdm=False)
            guarded(failures, "op profile", lambda: op_profile(run_few, device, Path(args.op_profile)))
        if device.type == "cuda":  # what a decode step's kernels cost here, one by one
            short = prompts[shortest][:64]
            got = guarded(
                failures, "launches", lambda: {**launch_cost(device), **decode_launches(llm, hf, short, device)}
            )
            if got is not None:
                results["launches"] = got
                print(
                    f"kernel launch {got['eager_launch_s'] * 1e6:.1f} us eager, {got['graph_kernel_s'] * 1e6:.2f} us "
                    f"in a CUDA graph; launches per decode step: ctxpar {got['ctxpar_launches_per_step']:.0f}, "
                    f"transformers {got['hf_launches_per_step']:.0f}",
                    flush=True,
                )
    gc.collect()
    if device.type == "cuda":
        results["ctxpar_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if "hf-speed" not in args.skip:
        with torch.no_grad():
            hf(torch.tensor([prompts[shortest][:512]], device=device), use_cache=False, logits_to_keep=1)  # warm-up
        for n, ids in prompts.items():
            got = guarded(failures, f"transformers speed {n}", lambda: hf_speed(hf, ids, args.decode_steps, device))
            if got is None:
                continue
            ttft, step, first, lp = got
            row = results["rows"][n]
            row.update(hf_ttft_s=ttft, hf_decode_s=step, hf_first=first)
            if "ctxpar_first" in row:  # the first token's logprob, both ways
                row["first_logprob_diff"] = abs(float(lp[row["ctxpar_first"]]) - row["ctxpar_lp"])
            print(f"transformers {n} tokens: TTFT {ttft:.3f} s, decode {step * 1e3:.2f} ms/token", flush=True)
    if profile is not None:
        for n, row in results["rows"].items():
            row["predicted_ttft_s"] = prefill_time(shape, profile, n, 0, 1, 1, 1, "gather").total_s
            row["predicted_decode_s"] = decode_time(shape, profile, n, 1, 1).total_s
    return results
