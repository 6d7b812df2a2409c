"""The fixed costs of a step (ctxpar/costmodel/fixed_costs.py) and their place in
timing.py: hop counts by hand, the host's time exposed on a CPU and hidden on a GPU
up to the device's work, CUDA graphs for decode only, and the published rows."""

from __future__ import annotations

import dataclasses

import pytest

from ctxpar.costmodel import load_hardware, load_model_shape
from ctxpar.costmodel.fixed_costs import allreduce_hops, fixed_s, ring_hops, tp_allreduce_s
from ctxpar.costmodel.published import NIM_LLAMA_70B_TP2
from ctxpar.costmodel.published_predictions import error
from ctxpar.costmodel.timing import decode_time, prefill_time

M70 = load_model_shape("llama-3-70b")
CPU = load_hardware("cpu-core-gloo")
GPU = load_hardware("h100x2-nvlink")


@pytest.mark.parametrize(
    "ranks, ring, tree, one_shot",
    # ring: reduce-scatter + all-gather, R - 1 steps each; tree: log2 R up, log2 R down
    [(1, 0, 0, 0), (2, 2, 2, 1), (3, 4, 4, 1), (4, 6, 4, 1), (8, 14, 6, 1), (9, 16, 8, 1)],
)
def test_allreduce_hops_by_hand(ranks: int, ring: int, tree: int, one_shot: int) -> None:
    assert (allreduce_hops(ranks, "ring"), allreduce_hops(ranks, "tree")) == (ring, tree)
    assert allreduce_hops(ranks, "one-shot") == one_shot
    assert ring_hops(ranks) == ranks - 1
    with pytest.raises(ValueError):
        allreduce_hops(0, "ring")


def test_tp_allreduce_by_hand() -> None:
    """A 2-layer model of hidden 1000, TP4 ring, 3 tokens in fp32: per all-reduce 6 hops
    and 3/4 of 2 x 12000 bytes; two all-reduces a layer."""
    m = dataclasses.replace(M70, num_layers=2, hidden_size=1000)
    h = dataclasses.replace(GPU, tp_size=4, tp_allreduce="ring", tp_latency_s=1e-6, tp_bandwidth=1e9)
    h = dataclasses.replace(h, activation_dtype="fp32")
    one = 6 * 1e-6 + 0.75 * 2 * 3 * 1000 * 4 / 1e9
    assert tp_allreduce_s(m, h, 3) == pytest.approx(2 * 2 * one)
    assert tp_allreduce_s(m, dataclasses.replace(h, tp_size=1), 3) == 0.0


def test_host_time_adds_on_a_cpu_and_hides_under_a_gpus_work() -> None:
    """10 layers of 5 kernels at 2 us plus 1 us a layer = 110 us of the host's layers, and
    100 us a step: a CPU adds both; a GPU shows only what its 60 us of work does not cover,
    nothing beyond 110 us of work; a graph replaces the layers by a replay and 50 gaps."""
    m = dataclasses.replace(M70, num_layers=10)
    terms = dict(kernels_per_layer=5, kernel_launch_s=2e-6, layer_overhead_s=1e-6, step_overhead_s=1e-4)
    cpu = dataclasses.replace(CPU, **terms)
    gpu = dataclasses.replace(GPU, **terms, graph_replay_s=20e-6, graph_kernel_s=0.5e-6)
    assert fixed_s(m, cpu, 60e-6, graphed=False) == pytest.approx(100e-6 + 110e-6)
    assert fixed_s(m, gpu, 60e-6, graphed=False) == pytest.approx(100e-6 + 50e-6)
    assert fixed_s(m, gpu, 200e-6, graphed=False) == pytest.approx(100e-6)
    assert fixed_s(m, gpu, 60e-6, graphed=True) == pytest.approx(100e-6 + 20e-6 + 50 * 0.5e-6)


def test_graphs_serve_decode_steps_and_never_a_prefill() -> None:
    """The same profile with and without graphs: a decode step changes by exactly the
    replay terms less the exposed launches; a prefill does not change at all."""
    eager = dataclasses.replace(GPU, decode_graphs=False, async_launch=False, graph_replay_s=30e-6)
    graphed = dataclasses.replace(eager, decode_graphs=True)
    launches = M70.num_layers * GPU.kernels_per_layer
    replay = 30e-6 + launches * GPU.graph_kernel_s
    d_eager, d_graph = decode_time(M70, eager, 4096, 1, 1), decode_time(M70, graphed, 4096, 1, 1)
    assert d_eager.overhead_s == pytest.approx(launches * GPU.kernel_launch_s)
    assert d_graph.overhead_s == pytest.approx(replay)
    assert d_graph.total_s - d_graph.overhead_s == pytest.approx(d_eager.total_s - d_eager.overhead_s)
    assert prefill_time(M70, graphed, 1024, 0, 1, 1, 1, "gather") == prefill_time(
        M70, eager, 1024, 0, 1, 1, 1, "gather"
    )


def test_fixed_costs_weigh_on_short_steps_and_fade_on_long_ones() -> None:
    """The same fixed terms are most of a short step and a vanishing share of a long prefill."""
    share = [
        (lambda b: b.overhead_s / b.total_s)(
            prefill_time(M70, dataclasses.replace(GPU, async_launch=False), n, 0, 1, 1, 1, "gather")
        )
        for n in (16, 512, 32768)
    ]
    assert share[0] > share[1] > share[2] and share[2] < 0.02


def test_dcp_all_to_all_pays_a_latency_per_other_rank() -> None:
    """A decode step's combine under DCP: D - 1 latencies a layer (pairwise all-to-all)."""
    slow = dataclasses.replace(GPU, link_latency_s=1e-3)
    for dcp in (2, 4):
        gain = decode_time(M70, slow, 65536, 1, dcp).comm_s - decode_time(M70, GPU, 65536, 1, dcp).comm_s
        assert gain == pytest.approx(M70.num_layers * (dcp - 1) * (1e-3 - GPU.link_latency_s))


def test_the_model_is_monotone_in_every_fixed_term() -> None:
    base = decode_time(M70, GPU, 8192, 4, 1).total_s
    for field, value in (
        ("graph_replay_s", 1e-4),
        ("graph_kernel_s", 2e-6),
        ("step_overhead_s", 1e-3),
        ("tp_latency_s", 3e-5),
    ):
        assert decode_time(M70, dataclasses.replace(GPU, **{field: value}), 8192, 4, 1).total_s > base


@pytest.mark.parametrize("step", NIM_LLAMA_70B_TP2, ids=lambda s: f"{s.kind}-{s.prompt}-{s.output}")
def test_published_steps_within_25_percent(step) -> None:
    """NVIDIA's NIM table (docs/scaling.md, "Decode and short prefills"); the row the
    profile's GEMM efficiency was fitted to is held within 2%."""
    assert abs(error(step)) < (0.02 if step.fitted else 0.25)
