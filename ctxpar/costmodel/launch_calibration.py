"""`ctxpar calibrate`'s launch terms (ctxpar/costmodel/fixed_costs.py): what one
kernel launched from Python costs, and on a GPU what a CUDA graph's replay and
each kernel inside it cost.

A launch is timed on a one-element add, whose kernel does next to nothing: on
the CPU the call is PyTorch's dispatch around it; on a GPU the host's launch,
the kernels queued back to back and the device synchronized once at the end.
A graph is timed at two sizes, one kernel and ``GRAPH_KERNELS``, so that the
per-kernel gap on the device and the replay's own cost come apart.

The GPU path cannot run without a GPU: it is checked by the prepared device
script (python -m ctxpar.bench.cuda_graph_check), not by the CPU tests.
"""

from __future__ import annotations

import torch

from ctxpar.costmodel.link_calibration import best_of

LAUNCHES = 2000  # eager launches timed per run
GRAPH_KERNELS = 200  # kernels in the larger graph
REPLAYS = 50  # replays timed per run
RUNS = 5  # best of


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_launch_s(device: torch.device, launches: int = LAUNCHES) -> float:
    """Seconds per tiny kernel launched from Python, back to back."""
    x = torch.zeros(1, device=device)

    def run() -> None:
        for _ in range(launches):
            x.add_(1.0)
        _sync(device)

    return best_of(run, RUNS) / launches


def graph_costs(device: torch.device) -> tuple[float, float]:
    """(graph_replay_s, graph_kernel_s) on a GPU: a replay's cost beyond its kernels
    (the host's call, the synchronize), and each kernel's inside a graph."""
    x = torch.zeros(1, device=device)
    times = {}
    for kernels in (1, GRAPH_KERNELS):
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):  # capture needs a side stream's first use to be warm
            x.add_(1.0)
        torch.cuda.synchronize(device)
        with torch.cuda.graph(graph):
            for _ in range(kernels):
                x.add_(1.0)

        def replay(g: torch.cuda.CUDAGraph = graph) -> None:
            for _ in range(REPLAYS):
                g.replay()
                torch.cuda.synchronize(device)

        times[kernels] = best_of(replay, RUNS) / REPLAYS
    per_kernel = max(0.0, (times[GRAPH_KERNELS] - times[1]) / (GRAPH_KERNELS - 1))
    return max(0.0, times[1] - per_kernel), per_kernel


def launch_terms(device: torch.device, layer_overhead_s: float, kernels_per_layer: int) -> dict[str, float]:
    """A calibrated profile's launch fields, from ``layer_overhead_s`` (the host's time a
    layer, launches included, measured through the engine) and the engine's kernels a
    layer (counted on a GPU; 0 on the CPU, where the layer's time is kept whole: its
    kernels run on the host and the compiled decode loop calls them from C++).

    On a GPU the launches are split out of the layer's host time, so they are not
    counted twice, and decode steps are priced as graph replays (the engine replays
    them where ``enforce_eager`` is False)."""
    launch = kernel_launch_s(device)
    if device.type != "cuda":
        return {"kernel_launch_s": launch}
    replay, per_kernel = graph_costs(device)
    return {
        "kernel_launch_s": launch,
        "kernels_per_layer": kernels_per_layer,
        "layer_overhead_s": max(0.0, layer_overhead_s - kernels_per_layer * launch),
        "async_launch": True,
        "decode_graphs": True,
        "graph_replay_s": replay,
        "graph_kernel_s": per_kernel,
    }
