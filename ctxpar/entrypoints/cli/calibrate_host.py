"""The host's share of a forward step, for the cost model: what a step costs beyond
its kernels' arithmetic and memory traffic (the Python around a dozen kernel calls
a layer, the scheduler, sampling and detokenizing). On a CPU decode of a small
model this is a third of the step (SmolLM2: ~3 of ~9 ms), and the roofline does
not see it.

It is measured on decode steps of two tiny random Llama models that differ only
in their layer count: their kernels take next to nothing, so a step's time is

    step_overhead_s + layers x layer_overhead_s

and the two models give both terms. The engine is the real one (``LLM``), in the
profile's dtype, on the profile's device. The cost model's measurements
(ctxpar/costmodel/hardware_calibration.py) sit below the engine, so `ctxpar calibrate` hands
them ``host_overhead``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LAYERS = (2, 10)  # the two models' layer counts
PROMPT, STEPS, RUNS = 16, 48, 3  # decode steps timed after a short prompt; best of RUNS
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _tiny_config(layers: int):
    from transformers import LlamaConfig

    # Widths the kernels take (multiples of 8), a few KB per layer: the kernels' work is noise.
    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )


def decode_step_seconds(llm: Any, context: int, steps: int, seed: int) -> tuple[float, float]:
    """Seconds per decode step of one request after `context` tokens, and the time of
    its prefill (a fresh random prompt per seed: no prefix-cache hit). The prefill is
    kept off the clock, which `LLM.generate` cannot do: the engine is stepped directly
    (`ctxpar bench quant` reports the same figure)."""
    import numpy as np

    from ctxpar import SamplingParams

    engine = llm.engine
    ids = np.random.default_rng(seed).integers(0, engine.vocab_size, size=context).tolist()
    engine.add_request(ids, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while all(len(q.output_token_ids) == 0 for q in engine.requests.values()):
        engine.step()  # the prefill
    prefill = time.perf_counter() - t0
    engine.step()  # one decode step to warm up
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - t0) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, prefill


def _tiny_engine(path: Path, dtype: str, device: torch.device, **options: Any) -> Any:
    """The engine over a random checkpoint at ``path``, which has no tokenizer: token ids
    in, token ids out."""
    from ctxpar import LLM

    return LLM(
        str(path),
        dtype=ENGINE_DTYPES[dtype],
        device=device.type,
        max_model_len=512,
        skip_tokenizer_init=True,
        **options,
    )


def decode_step_s(path: Path, dtype: str, device: torch.device, ranks: int = 1, threads: int | None = None) -> float:
    """Seconds of one decode step of the model at ``path`` on ``ranks`` ranks of ``threads``
    threads (one host: rank 0 leads the step): the best of RUNS runs of STEPS steps."""
    with _tiny_engine(path, dtype, device, pcp_size=ranks, num_threads=threads) as llm:
        return min(decode_step_seconds(llm, PROMPT, STEPS, seed=run)[0] for run in range(RUNS))


def host_overhead(dtype: str, device: torch.device, ranks: int = 1, threads: int | None = None) -> tuple[float, float]:
    """(step_overhead_s, layer_overhead_s) of this host running ctxpar's engine in ``dtype``:
    one rank, or ``ranks`` of ``threads`` threads each sharing it, whose decode steps rank 0
    leads (the plan's broadcast to the ranks, the step's KV sent to them, included)."""
    from ctxpar.models.random_checkpoint import save_random_model

    with tempfile.TemporaryDirectory() as tmp:
        times = [
            decode_step_s(
                save_random_model(_tiny_config(n), Path(tmp) / f"layers{n}", seed=0), dtype, device, ranks, threads
            )
            for n in LAYERS
        ]
    layer = max(0.0, (times[1] - times[0]) / (LAYERS[1] - LAYERS[0]))
    return max(0.0, times[0] - LAYERS[0] * layer), layer


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")  # runtime calls


def launches(fn: Callable[[], Any], device: torch.device) -> int:
    """Kernels ``fn`` launches (torch.profiler's count of the CUDA runtime's launch calls)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)


def kernels_per_layer(dtype: str, device: torch.device) -> int:
    """Kernels a decode step of ctxpar's engine launches a layer on ``device`` (a GPU): the
    two tiny models' launches a step (torch.profiler's count of the CUDA runtime's launch
    calls over STEPS eager steps), their difference over their layers' difference."""
    from ctxpar.models.random_checkpoint import save_random_model

    counts = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in LAYERS:
            path = save_random_model(_tiny_config(n), Path(tmp) / f"layers{n}", seed=0)
            # Eager: launches are what is counted, and a graph would hide them.
            with _tiny_engine(path, dtype, device, enforce_eager=True) as llm:
                decode_step_seconds(llm, PROMPT, 2, seed=0)  # warm-up
                counts.append(launches(lambda: decode_step_seconds(llm, PROMPT, STEPS, seed=1), device) / STEPS)
    return max(0, round((counts[1] - counts[0]) / (LAYERS[1] - LAYERS[0])))
