"""ctxpar on a GPU, one rank: correctness against transformers on the same
weights on the same device, then speed against transformers and the cost model.

1. Correctness (small random models of SmolLM2's shapes, Qwen3's and
   DeepSeek-V3's MLA + MoE, in float32 and bfloat16): a batch of prompts of
   different lengths with chunked prefill, then a prefix-cache hit, through
   ``LLM`` on ``--device``. Teacher-forced prompt logprobs (each prompt token's
   log-softmax) against transformers' forward pass, greedy tokens against its
   ``generate``; the KV cache in int8 and fp8 too; and the same batch through
   ctxpar on the CPU (float32), the path CI tests.
2. Speed (a random model of ``--speed-model``'s shapes, bf16): TTFT of one
   prompt per ``--lengths`` and the decode step after it, through ``LLM``,
   against transformers' own forward (its SDPA attention) on the same weights,
   and against ``ctxpar estimate``'s prediction for a profile measured here
   (``ctxpar calibrate --device``'s). The weights are made on the device and
   handed to ctxpar's loader in place of a checkpoint's files (16 GB need not
   cross a disk); everything after the loader's read is ctxpar's normal path.

``--device cpu`` with small sizes rehearses the whole run where no GPU is.
One rank only: NCCL between ranks needs a GPU each.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ctxpar.checks import positive_int

MODELS = ("smollm2", "qwen3", "deepseek-v3")  # correctness_configs' names
TIE = 0.05  # a top-2 logit gap under this is a near-tie: two correct engines may pick either token


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where ctxpar and transformers run")
    p.add_argument("--prompt-lens", type=positive_int, nargs="+", default=[37, 200, 515, 1100], help="the batch")
    p.add_argument("--max-new", type=positive_int, default=16, help="greedy tokens per prompt")
    p.add_argument(
        "--models", nargs="+", default=list(MODELS), choices=MODELS, help="the correctness models (default: all)"
    )
    p.add_argument("--layers", type=positive_int, default=4, help="layers of the correctness models")
    p.add_argument("--lengths", type=positive_int, nargs="*", default=[8192, 32768], help="TTFT prompt lengths")
    p.add_argument("--speed-model", default="llama-3-8b", help="a built-in model of ctxpar estimate")
    p.add_argument("--speed-layers", type=positive_int, default=None, help="fewer layers than the model's")
    p.add_argument("--decode-steps", type=positive_int, default=32, help="decode steps timed after each prompt")
    p.add_argument("--skip", nargs="*", default=[], choices=("correctness", "speed", "calibrate", "hf-speed"))
    p.add_argument(
        "--hardware", default=None, help="predict with this profile (ctxpar estimate's --hardware); default: calibrate"
    )
    p.add_argument("--hardware-out", default=None, help="write the profile calibrated here (JSON)")
    p.add_argument("--op-profile", default=None, help="write torch.profiler's table of a short run here")
    p.add_argument("--json", default=None, help="write every figure here (JSON)")


# -- models ---------------------------------------------------------------------------------------------------


def correctness_configs(layers: int) -> dict[str, Any]:
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config

    none = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return {
        # SmolLM2-135M's shapes (9 query / 3 KV heads of 64, tied embeddings), fewer layers.
        "smollm2": LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=layers,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            **none,
        ),
        # Qwen3's per-head q/k norms and head_dim 128 != hidden / heads.
        "qwen3": Qwen3Config(
            vocab_size=32768,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=max(2, layers // 2),
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            **none,
        ),
        # DeepSeek-V3: MLA (latent KV) and MoE, interleaved rope; float32 only (bf16 flips routing).
        "deepseek-v3": DeepseekV3Config(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=64,
            num_hidden_layers=max(2, layers // 2),
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=96,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            **none,
        ),
    }


def save_random_model(config, path: Path, seed: int) -> Path:
    """A random transformers model of ``config``, saved as a checkpoint (weights scaled
    up so that the top logits are rarely near-ties)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(2.0)
            else:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@contextlib.contextmanager
def weights_from(state: dict[str, Any]) -> Iterator[None]:
    """ctxpar's loader reads ``state`` (HF names -> tensors, on the device already) instead of
    the checkpoint directory's *.safetensors: a 16 GB model need not be written and read back."""
    from ctxpar.models import loader

    def files(d: Path, shown: Path) -> list[Path]:
        return [Path(d) / "model.safetensors"]  # never opened

    def tensors(files: list[Path], keep: Any = lambda name: True) -> Iterator[tuple[str, Any]]:
        return ((k, v) for k, v in state.items() if keep(k))

    saved = loader._safetensors_files, loader._iter_safetensors
    loader._safetensors_files, loader._iter_safetensors = files, tensors  # type: ignore[assignment]
    try:
        yield
    finally:
        loader._safetensors_files, loader._iter_safetensors = saved


# -- correctness ----------------------------------------------------------------------------------------------


def hf_reference(model, prompts: list[list[int]], max_new: int, device) -> list[dict]:
    """Per prompt: transformers' prompt logprobs (n-1,), its greedy tokens and their logits."""
    import torch

    refs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            logits = model(x).logits[0].float()  # (n, vocab)
            lp = torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None])[:, 0].cpu()
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
            refs.append(
                {
                    "prompt_lp": lp,
                    "tokens": out.sequences[0, len(ids) :].tolist(),
                    "logits": torch.cat(out.logits).float().cpu(),
                }
            )
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


def guarded(failures: dict[str, str], key: str, fn: Callable[[], Any]) -> Any:
    """fn(), or None with its traceback printed and kept under ``key``: one broken case
    must not cost the figures of the others (a GPU's time is scarce)."""
    try:
        return fn()
    except Exception:
        failures[key] = traceback.format_exc()
        print(f"{key}: FAILED\n{failures[key]}", flush=True)
        return None


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


# -- speed ----------------------------------------------------------------------------------------------------


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
    """ctxpar's TTFT (best of 2), decode step after the prompt, first token and its logprob."""
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
    many = SamplingParams(max_tokens=1 + steps, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], many, use_tqdm=False)
    return best, (time.perf_counter() - t0 - best) / steps, first, lp


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


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")  # runtime calls


def launches(fn: Callable[[], Any], device) -> int:
    """Kernels ``fn`` launches (torch.profiler's count of the CUDA runtime's launch calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)


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
    from ctxpar.costmodel.shapes import load_model_shape
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


# -- the run --------------------------------------------------------------------------------------------------


def environment(device) -> dict:
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def run(args: argparse.Namespace) -> None:
    import torch

    from ctxpar.costmodel.calibrate import calibrate
    from ctxpar.device import resolve_device
    from ctxpar.errors import CtxparError

    device = resolve_device(args.device)
    results: dict = {"environment": environment(device)}
    failures: dict[str, str] = {}
    print(json.dumps(results["environment"]), flush=True)

    def save() -> None:  # after each section: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({**results, "failures": failures}, indent=2, default=str) + "\n")

    profile = None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "correctness" not in args.skip:
            results["correctness"] = correctness(args, device, tmp, failures)
            save()
        if args.hardware:
            from ctxpar.costmodel.profiles import load_hardware

            profile = load_hardware(args.hardware)
        elif "calibrate" not in args.skip:
            progress = lambda line: print(line, flush=True)
            profile = guarded(
                failures, "calibrate", lambda: calibrate(torch.get_num_threads(), "bf16", "shm", progress, device)
            )
            if profile is not None:
                results["profile"] = json.loads(profile.to_json())
                if args.hardware_out:
                    Path(args.hardware_out).write_text(profile.to_json())
            save()
        if "speed" not in args.skip and args.lengths:
            results["speed"] = guarded(failures, "speed", lambda: speed(args, device, tmp, profile, failures))
            save()
    if results.get("speed"):
        _speed_table(results["speed"])
    if failures:
        raise CtxparError(f"{len(failures)} case(s) failed: {', '.join(failures)} (tracebacks above)")


SPEED_COLUMNS = (  # (header, key, scale, unit)
    ("TTFT ctxpar", "ctxpar_ttft_s", 1.0, "s"),
    ("TTFT HF", "hf_ttft_s", 1.0, "s"),
    ("predicted", "predicted_ttft_s", 1.0, "s"),
    ("decode ctxpar", "ctxpar_decode_s", 1e3, "ms"),
    ("decode HF", "hf_decode_s", 1e3, "ms"),
    ("predicted", "predicted_decode_s", 1e3, "ms"),
)


def _speed_table(s: dict) -> None:
    print(f"\n{s['model']} ({s['layers']} layers), bf16, P = 1:")
    print(f"{'prompt':>7} | " + " | ".join(f"{h:>13}" for h, *_ in SPEED_COLUMNS))
    for n, r in s["rows"].items():
        cells = [f"{r[k] * scale:.4g} {unit}" if k in r else "-" for _, k, scale, unit in SPEED_COLUMNS]
        print(f"{n:>7} | " + " | ".join(f"{c:>13}" for c in cells))
