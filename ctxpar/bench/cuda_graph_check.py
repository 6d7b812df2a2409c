"""The prepared GPU check of CUDA-graph decode (issue 42): one command, one GPU.

    python -m ctxpar.bench.cuda_graph_check --json graphs.json

1. Launch terms (ctxpar/costmodel/launch_calibration.py): a kernel launched from
   Python, a graph's replay, a kernel inside a graph.
2. A random Llama-3-8B-shaped model in bf16 (``--layers`` fewer to save time),
   through ``LLM`` twice: CUDA graphs on (the default) and ``enforce_eager``.
   - the graphs' memory (``DecodeGraphs.describe``), as `generate --verbose` would print it;
   - capture is exact: one captured step replayed against the same static step run
     eagerly on the same buffers, compared with ``==``;
   - outputs: greedy tokens of ``--batch`` prompts, graphs on against off (tokens
     equal, and the largest difference of the sampled tokens' logprobs: the two
     paths' attention sums over different key counts, so equal bits are measured,
     not assumed);
   - decode ms/token at batch 1 and ``--batch`` against the HBM floor: the weights'
     and KV cache's bytes over the bandwidth measured here (goals: 1.5x at batch 1,
     2x at batch 32).

``--device cpu --layers 2`` rehearses the script where no GPU is (no graphs there).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ctxpar.bench.cuda_models import weights_from
from ctxpar.bench.cuda_speed import make_speed_model, speed_config


def _runner(llm: Any) -> Any:
    """The one rank's target ModelRunner of an in-process engine."""
    return llm.engine.executor.runner.target


def _generate(llm: Any, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[list[float]], float]:
    """Greedy tokens and their logprobs of each prompt, and seconds per decode step (a run of
    1 + steps tokens less a run of 1, the same prompts)."""
    from ctxpar import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in prompts]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=1 + steps, temperature=0, ignore_eos=True, logprobs=0)
    llm.generate(inputs, one, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(inputs, one, use_tqdm=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(inputs, many, use_tqdm=False)
    step = (time.perf_counter() - t0 - first) / steps
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])] for o in outs]
    return tokens, logprobs, step


def _replay_is_exact(runner: Any) -> bool:
    """A captured graph's output against the same static step run eagerly, on the same buffers."""
    import torch

    from ctxpar.worker.graph_runner import static_decode_forward

    graphs = runner.graphs
    batch, keys = graphs.plan.graphs[-1]  # the smallest
    graph, out = graphs.graphs[batch, keys]
    graph.replay()
    replayed = out.clone()
    eager = static_decode_forward(
        graphs.model, graphs.kv_caches, graphs.kv_quant, graphs.buffers, graphs.tokens, batch, keys, graphs.block_size
    )
    torch.cuda.synchronize()
    return bool(torch.equal(replayed, eager))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import torch

    from ctxpar import LLM
    from ctxpar.costmodel.hardware_calibration import read_bandwidth
    from ctxpar.costmodel.launch_calibration import graph_costs, kernel_launch_s
    from ctxpar.costmodel.shapes import load_model_shape

    device = torch.device(args.device)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    out["kernel_launch_s"] = kernel_launch_s(device)
    if device.type == "cuda":
        out["graph_replay_s"], out["graph_kernel_s"] = graph_costs(device)
    ns = argparse.Namespace(
        speed_model="llama-3-8b", speed_layers=args.layers, lengths=[args.prompt], decode_steps=args.steps
    )
    config = speed_config(ns)
    config.architectures = ["LlamaForCausalLM"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, args.prompt).tolist() for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        config.save_pretrained(path)
        hf = make_speed_model(config, device)
        state = hf.state_dict()
        del hf
        shape = load_model_shape(str(path))
        bandwidth = read_bandwidth(device)
        results = {}
        for mode, eager in (("graphs", False), ("eager", True)):
            with weights_from(state):
                llm = LLM(
                    str(path),
                    device=device.type,
                    dtype="bfloat16",
                    max_model_len=args.prompt + args.steps + 64,
                    max_num_seqs=args.batch,
                    enable_prefix_caching=False,
                    enforce_eager=eager,
                    skip_tokenizer_init=True,
                )
            with llm:
                runner = _runner(llm)
                row: dict[str, Any] = {}
                if runner.graphs is not None:
                    row["graphs"] = runner.graphs.describe()
                    row["graph_memory_bytes"] = runner.graphs.memory_bytes
                    row["replay_equals_static_step"] = _replay_is_exact(runner)
                for batch in (1, args.batch):
                    tokens, logprobs, step = _generate(llm, prompts[:batch], args.steps)
                    context = args.prompt + args.steps // 2
                    floor = shape.total_params * 2 + batch * context * shape.kv_bytes("auto", 2) * shape.num_layers
                    row[f"batch{batch}"] = {
                        "decode_ms": step * 1e3,
                        "hbm_floor_ms": floor / bandwidth * 1e3,
                        "over_floor": step / (floor / bandwidth),
                        "tokens": tokens,
                        "logprobs": logprobs,
                    }
                    ratio = row[f"batch{batch}"]["over_floor"]
                    print(f"{mode} batch {batch}: {step * 1e3:.2f} ms/token, {ratio:.2f}x the floor", flush=True)
            results[mode] = row
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out.update(results)
    for batch in (1, args.batch):
        a, b = results["graphs"][f"batch{batch}"], results["eager"][f"batch{batch}"]
        out[f"batch{batch}_tokens_equal"] = a["tokens"] == b["tokens"]
        diffs = [abs(x - y) for ra, rb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(ra, rb)]
        out[f"batch{batch}_max_logprob_diff"] = max(diffs, default=0.0)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ctxpar.bench.cuda_graph_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than Llama-3-8B's 32")
    p.add_argument("--prompt", type=int, default=512, help="tokens of each prompt")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--batch", type=int, default=32, help="the larger batch (and max_num_seqs)")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    out = run(args)
    summary = {k: v for k, v in out.items() if k not in ("graphs", "eager")}
    print(json.dumps(summary, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
