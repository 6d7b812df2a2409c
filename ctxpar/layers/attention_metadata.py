"""Each step's attention metadata, built next to the attention that reads it (as
vLLM's AttentionMetadataBuilder): from the runner's ``StepDescription``, the
``ForwardContext`` of forward_context.py (and under DCP its ``DCPStep``,
dcp_metadata.py). The runner says what the step is; which KV entries each
layer writes and where, and which keys each local row reads, are decided here;
where attention runs (ctxpar's kernels or PyTorch) is decided once, when the
builder is made at load, and carried in every step's context.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ctxpar.layers.attention.backend import default_backend
from ctxpar.layers.dcp_metadata import dcp_step
from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.kv_quant import KVQuant
from ctxpar.layers.step_description import StepDescription, slots_of, token_slots

log = logging.getLogger(__name__)


class AttentionMetadataBuilder:
    """One model's KV cache on one rank: builds the ForwardContext of each step."""

    def __init__(self, kv_caches: list[torch.Tensor], kv_quant: KVQuant | None, device: torch.device) -> None:
        """kv_caches: per layer (slots, *entry), or quantized rows (``kv_quant``'s format)."""
        self.kv_caches = kv_caches
        self.kv_quant = kv_quant
        self.device = device
        self.backend = default_backend(device)  # the rank's, for every step (ctxpar/layers/attention/backend.py)
        log.debug("attention backend on %s: %s", device, self.backend.name)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """An int64 array as a tensor on the rank's device."""
        return torch.tensor(a, dtype=torch.int64, device=self.device)

    def build(self, step: StepDescription) -> ForwardContext:
        """The context every layer of ``step`` reads on this rank."""
        rows = step.rows
        writes, token_of = self._entries(step)
        if step.shard is None:
            slots = step.slots
            context_slots = [
                self._to_device(slots_of(step.block_tables[r], np.arange(s), step.block_size))
                for r, s in zip(rows.req_idx.tolist(), rows.seq_lens.tolist())
            ]
            dcp = None
        else:
            # Each token sits at its index among the tokens its owner stores, and only
            # the owner writes it; the layers attend through attention/sharded.py.
            row, pos = step.tokens
            slots = token_slots(step.block_tables, row, step.shard.local_position(pos), step.block_size)
            writes = writes & (step.shard.owner(pos) == step.rank)[token_of]
            context_slots = []
            dcp = dcp_step(step, self._to_device)
        write_src = np.flatnonzero(writes)
        return ForwardContext(
            query_start_loc=rows.query_start_loc.tolist(),
            start_pos=rows.start_pos.tolist(),
            seq_lens=rows.seq_lens.tolist(),
            context_slots=context_slots,
            write_src=None if writes.all() else self._to_device(write_src),
            write_slots=self._to_device(slots[token_of[write_src]]),
            kv_caches=self.kv_caches,
            kv_quant=self.kv_quant,
            gather=step.all_gather if step.gathers else None,
            dcp=dcp,
            prompt_lens=step.prompt_lens[rows.req_idx].tolist(),
            backend=self.backend,
        )

    @staticmethod
    def _entries(step: StepDescription) -> tuple[np.ndarray, np.ndarray]:
        """Which of the KV entries an attention layer holds get written, as a mask
        over exactly those entries, and each entry's token of the step."""
        if step.gathers:
            # The P*n gathered entries: every rank writes every token of the step
            # (rank 0's copy of replicated rows).
            return step.layout.kv_write_mask, step.layout.padded_gather_idx
        # No gather: the n local entries, each rank writing its own (identical) copy of every token.
        rows = step.rows
        return ~rows.is_padding, rows.token_idx
