"""The costs of a forward step that do not grow with its tokens: the host's work,
kernel launches, and the latency of each collective's hops.

A long prefill hides them; a decode step or a short prefill is made of them
(a 70B model's decode step on two GPUs reads its weights in ~13 ms and pays
a few ms of these). Every step is priced from the same terms (timing.py):

- the host, once a step (``step_overhead_s``: scheduler, sampling, outputs) and
  once a layer (``layer_overhead_s`` + ``kernels_per_layer`` x
  ``kernel_launch_s``: the Python around the layer and its launches). On a CPU
  the host runs the kernels itself, so this adds to their time; on a GPU
  (``async_launch``) the host queues kernels while the device runs earlier
  ones, and only the host time beyond the device's shows.
- with CUDA graphs (``decode_graphs``, decode steps only: a prefill's shapes
  vary), one replay (``graph_replay_s``) replaces the layers' host time, and
  the device pays ``graph_kernel_s`` between each two of the step's kernels.
- a collective of R ranks pays one latency per hop, hops set by its algorithm:
  an all-reduce by ring 2(R-1) (reduce-scatter then all-gather), by tree
  2 ceil(log2 R) (up then down), one-shot 1; an all-gather over a ring R-1;
  an all-to-all by pairwise exchange R-1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctxpar.costmodel.hardware import ALLREDUCE_HOPS

if TYPE_CHECKING:
    from ctxpar.costmodel.hardware import HardwareProfile
    from ctxpar.costmodel.shapes import ModelShape


def allreduce_hops(ranks: int, algorithm: str) -> int:
    """Latencies one all-reduce among ``ranks`` ranks pays (0 for a single rank)."""
    if ranks < 1:
        raise ValueError(f"an all-reduce needs at least one rank, got {ranks}")
    return 0 if ranks == 1 else ALLREDUCE_HOPS[algorithm](ranks)


def ring_hops(ranks: int) -> int:
    """Latencies an all-gather over a ring, or a pairwise all-to-all, of ``ranks`` ranks pays."""
    if ranks < 1:
        raise ValueError(f"a collective needs at least one rank, got {ranks}")
    return ranks - 1


def tp_allreduce_s(m: ModelShape, h: HardwareProfile, tokens: float) -> float:
    """The TP all-reduces of a step of ``tokens`` tokens on one rank: two per layer (after
    attention's output projection and after the MLP), each moving the tokens' hidden states:
    its hops' latencies plus (tp - 1)/tp of twice the bytes (a reduce-scatter then an
    all-gather) at the TP bandwidth."""
    if h.tp_size == 1:
        return 0.0
    nbytes = tokens * m.hidden_size * h.act_bytes * 2 * (h.tp_size - 1) / h.tp_size
    one = allreduce_hops(h.tp_size, h.tp_allreduce) * h.tp_latency_s + nbytes / h.tp_bandwidth
    return m.num_layers * 2 * one


def layers_host_s(m: ModelShape, h: HardwareProfile) -> float:
    """The host's time for a step's layers when each is launched from the host."""
    return m.num_layers * (h.layer_overhead_s + h.kernels_per_layer * h.kernel_launch_s)


def fixed_s(m: ModelShape, h: HardwareProfile, device_s: float, graphed: bool) -> float:
    """Seconds a step takes beyond ``device_s``, its kernels' own work (compute, memory
    and collectives): the host's step, and its layers' host time, exposed (a CPU; a GPU
    only where the host is the slower) or replaced by a graph's replay (``graphed``)."""
    if graphed:
        kernels = m.num_layers * h.kernels_per_layer
        return h.step_overhead_s + h.graph_replay_s + kernels * h.graph_kernel_s
    layers = layers_host_s(m, h)
    return h.step_overhead_s + (max(0.0, layers - device_s) if h.async_launch else layers)
