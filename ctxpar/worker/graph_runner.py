"""Decode steps replayed from CUDA graphs (a GPU only; the CPU runs its compiled
decode loop instead, ctxpar/models/compiled_decode.py).

At start-up a rank captures, for every (batch size, key bucket) of its
``CapturePlan`` (cuda_graphs.py), the model's forward over the static buffers:
the slot table from the buffers' block tables and lengths, then the layers,
whose attention reads that table (the step's decode group, handed to
attention/paged.py through the step's memo as it would have built it), writes
each row's new KV entry at the buffers' slot, and attends every row over its
padded keys with the mask the lengths give. A step of decodes on one rank then
costs a copy of its inputs into the buffers and one replay.

Served: models that offer a fast decode step (``CausalLM.fast_decode``, whose
``DecodeShape`` bounds the graphs' memory), one rank (no PCP, no DCP: their
collectives inside graphs are not written), steps whose rows are all decodes,
fitting a captured graph. Everything else runs eagerly, as with
``enforce_eager=True``. This file was written without a GPU to run it on:
``python -m ctxpar.bench.cuda_graph_check`` checks it on one.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ctxpar.layers.attention.backend import DecodeGroup
from ctxpar.layers.forward_context import DecodeBatch, ForwardContext
from ctxpar.layers.kv_quant import KVQuant
from ctxpar.models.base import CausalLM, DecodeShape
from ctxpar.worker.cuda_graphs import CapturePlan, StaticBuffers, capture_sizes, key_buckets, slot_table
from ctxpar.worker.step_plan import StepPlan

log = logging.getLogger(__name__)


class DecodeGraphs:
    """One model's decode graphs on one GPU, over its KV caches."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        kv_quant: KVQuant | None,
        plan: CapturePlan,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.kv_quant = model, kv_caches, kv_quant
        self.plan, self.block_size = plan, block_size
        self.buffers = StaticBuffers(plan.sizes[-1], plan.buckets[-1] // block_size, device)
        self.tokens = torch.arange(plan.sizes[-1], device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        for batch, keys in plan.graphs:  # largest first: the others reuse its pool's blocks
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # a warm-up off the capture (cuBLAS' workspaces, lazy inits)
                self._step(batch, keys)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._step(batch, keys)
            self.graphs[batch, keys] = (graph, out)
        torch.cuda.synchronize(device)
        self.memory_bytes = torch.cuda.memory_reserved(device) - before
        log.info(self.describe())

    @classmethod
    def build(
        cls,
        model: CausalLM,
        shape: DecodeShape,
        kv_caches: list[torch.Tensor],
        kv_quant: KVQuant | None,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> DecodeGraphs | None:
        """The graphs of ``model``, whose decode step has this ``shape`` (its
        ``fast_decode``), or None off a GPU: its steps then run eagerly."""
        if device.type != "cuda":
            return None
        plan = CapturePlan(capture_sizes(max_num_seqs), key_buckets(max_model_len, block_size), shape)
        return cls(model, kv_caches, kv_quant, plan, block_size, device)

    def describe(self) -> str:
        """One line for ``generate --verbose``: what was captured and what it holds."""
        return (
            f"CUDA graphs: {len(self.graphs)} decode graphs (batch {self.plan.sizes[0]}-{self.plan.sizes[-1]}, "
            f"keys {self.plan.buckets[0]}-{self.plan.buckets[-1]}), {self.memory_bytes / 2**20:.0f} MiB "
            f"(bound {self.plan.memory_bound / 2**20:.0f} MiB)"
        )

    def _step(self, batch: int, keys: int) -> torch.Tensor:
        return static_decode_forward(
            self.model, self.kv_caches, self.kv_quant, self.buffers, self.tokens, batch, keys, self.block_size
        )

    def graph_for(self, plan: StepPlan) -> tuple[int, int] | None:
        """The graph that replays ``plan`` on one rank, or None: only steps whose rows are
        all decodes (one token past the prompt) with no target states to take in."""
        q = plan.num_scheduled_tokens
        if plan.hidden_states is not None or len(q) == 0 or bool(plan.is_prefilling.any()) or bool((q != 1).any()):
            return None
        return self.plan.fit(len(q), int(plan.num_computed_tokens.max()) + 1)

    def forward(self, plan: StepPlan, graph: tuple[int, int]) -> torch.Tensor:
        """The step's hidden states (rows, hidden), replayed in ``graph`` (``graph_for``'s)."""
        rows = len(plan.input_ids)
        self.buffers.fill(
            np.asarray(plan.input_ids), plan.num_computed_tokens, plan.block_tables, self.block_size, graph[0]
        )
        captured, out = self.graphs[graph]
        captured.replay()
        return out[:rows]


def static_decode_forward(
    model: CausalLM,
    kv_caches: list[torch.Tensor],
    kv_quant: KVQuant | None,
    buffers: StaticBuffers,
    tokens: torch.Tensor,
    batch: int,
    keys: int,
    block_size: int,
) -> torch.Tensor:
    """The model's forward over the buffers' first ``batch`` rows, ``keys`` keys each:
    what a graph captures (every shape fixed by ``batch`` and ``keys``, every input read
    from ``buffers``). ``tokens``: arange of at least ``batch``. Returns the hidden
    states (batch, hidden). It runs on any device; on the CPU only where ctxpar's kernels
    are off (they read the cache their own way, not through the slot table)."""
    lengths = buffers.seq_lens[:batch]
    group = DecodeGroup(tokens[:batch], buffers.write_slots[:0], buffers.seq_lens[:0])
    # paged_attention reads a group's (table, lengths) through its cached `padded`:
    # here the table the graph computes from the buffers, not one built on the host.
    group.__dict__["padded"] = (slot_table(buffers.block_tables[:batch], lengths, keys, block_size), lengths)
    ctx = ForwardContext(
        query_start_loc=list(range(batch + 1)),
        start_pos=[0] * batch,  # read only by steps with prompt positions, which a decode has none of
        seq_lens=[1] * batch,
        context_slots=[],
        write_src=None,
        write_slots=buffers.write_slots[:batch],
        kv_caches=kv_caches,
        kv_quant=kv_quant,
    )
    ctx.memo.decode_batches[False] = DecodeBatch([0] * batch, [group], whole=True)
    return model.forward(buffers.ids[:batch], buffers.positions[:batch], ctx)
