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
import json
import tempfile
from pathlib import Path
from typing import Any

from ctxpar.bench.cuda_correctness import MODELS, correctness
from ctxpar.bench.cuda_models import guarded
from ctxpar.bench.cuda_speed import speed
from ctxpar.checks import positive_int


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


def environment(device) -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def run(args: argparse.Namespace) -> None:
    import torch

    from ctxpar.costmodel.hardware_calibration import calibrate
    from ctxpar.device import resolve_device
    from ctxpar.entrypoints.cli.calibrate_host import host_overhead
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
                failures,
                "calibrate",
                lambda: calibrate(torch.get_num_threads(), "bf16", "shm", progress, host_overhead, device),
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
