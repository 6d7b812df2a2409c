"""ModelRunner: one rank's share of every step.

Every rank (rank 0 included) runs the same code on the same StepPlan:

    StepPlan ──► PCP layout (pure, identical on all ranks)
             ──► this rank's local rows: ids, positions, cache slots
             ──► model forward (each attention layer: gather KV over ranks,
                 write the cache, attend)
             ──► hidden states of the sampled tokens reach rank 0 ──► logits

Any branch that leads into a collective is decided from the plan and the
layout alone, which every rank has, so all ranks always enter the same
collectives with the same shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.kv_quant import KVQuant
from ctxpar.layers.linear import row_parts
from ctxpar.models.base import CausalLM
from ctxpar.models.compiled_decode import CompiledDecode
from ctxpar.parallel.comm import PCPGroup
from ctxpar.parallel.dcp_shard import DCPShard
from ctxpar.parallel.pcp import PCPLayout, plan_pcp_layout, split_mask
from ctxpar.worker.dcp_step import dcp_step
from ctxpar.worker.kv_cache import allocate_kv_caches, slots_of
from ctxpar.worker.options import RunnerOptions
from ctxpar.worker.step_inputs import check_block_tables, rank_order, token_rows_positions, token_slots
from ctxpar.worker.step_plan import StepOutput, StepPlan

COPY_SLOTS = 1024  # cache slots per piece of a KV copy (copy_blocks): what a led step of 1K tokens holds


class ModelRunner:
    def __init__(
        self, model: CausalLM, options: RunnerOptions, device: torch.device, group: PCPGroup | None = None
    ) -> None:
        """group: the PCP group of this rank, or None for a single rank."""
        self.model = model
        self.options = options
        self.block_size = options.block_size
        self.device = device
        if options.dcp_size not in (1, group.size if group is not None else 1):
            raise ValueError(f"dcp_size must be 1 or the group size, got {options.dcp_size}")
        self.rejoin(group)
        self.spread_min_rows = options.spread_min_rows
        self.threads = torch.get_num_threads()
        self._led_buffer = torch.empty(0, dtype=options.dtype, device=device)  # led steps' KV, see _share_led_kv
        self.kv_quant = KVQuant.of(options.kv_cache_dtype, tuple(model.kv_entry_shape), tuple(model.kv_scale_runs))
        self.kv_stack = allocate_kv_caches(  # (layers, slots, *entry)
            model.num_kv_layers,
            options.num_blocks * options.block_size,
            model.kv_entry_shape,
            options.dtype,
            device,
            self.kv_quant,
        )
        self.kv_caches = list(self.kv_stack.unbind(0))  # per layer (slots, *entry): views of the stack
        # Steps of decodes as one compiled call where the model allows it (enforce_eager: never).
        self.compiled = None if options.enforce_eager else CompiledDecode.build(model, self.kv_caches, self.kv_quant)

    def rejoin(self, group: PCPGroup | None) -> None:
        """Run in this group: at start-up, and after a lost rank the re-formed one,
        smaller when the lost rank was left out. Under DCP the KV is then sharded
        over the ranks left (the engine has the requests recompute it)."""
        self.group = group
        self.rank = group.rank if group is not None else 0
        self.pcp_size = group.size if group is not None else 1
        self.lead_threads = self.options.lead_threads if self.pcp_size > 1 else None
        sharded = self.options.dcp_size > 1 and self.pcp_size > 1
        self.shard = DCPShard(self.pcp_size, self.options.cp_interleave, self.rank) if sharded else None

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput | None:
        """Run one step. Returns, on rank 0, the float32 logits (L, vocab) of the tokens
        of ``plan.logits_token_indices()`` (the last token of each row with needs_logits;
        every token of an all_logits row), in order, and the hidden states of
        ``plan.hidden_token_indices()``; None on the other ranks. Raises ValueError,
        before any kernel runs, if a row's slots would fall outside the KV cache."""
        self._check_slots(plan)
        layout = plan_pcp_layout(
            plan.num_scheduled_tokens,
            plan.num_computed_tokens,
            plan.is_prefilling,
            self.pcp_size,
            replicate_below=self.options.pcp_min_tokens,
            spread_min_rows=self.spread_min_rows,
            split_ranks=self._split_ranks(plan),
        )
        gathers = self.pcp_size > 1 and not layout.is_all_replicated  # some row split or assigned
        led = self.lead_threads is not None and not gathers
        if led and self.rank != 0:  # rank 0 computes this step alone; this rank stores its new KV
            self._share_led_kv(plan)
            return None
        rows = layout.rank_rows(self.rank)
        to_dev = lambda a: torch.tensor(a, dtype=torch.int64, device=self.device)

        # Which of the KV entries an attention layer holds get written, as a mask over exactly
        # those entries: the P*n gathered ones in a split step, the n local ones otherwise.
        if gathers:
            # Every rank writes every token of the step (rank 0's copy of replicated rows).
            writes, token_of = layout.kv_write_mask, layout.padded_gather_idx
        else:
            # No gather: each rank writes its own (identical) copy of every token.
            writes, token_of = ~rows.is_padding, rows.token_idx
        token_row, token_pos = token_rows_positions(plan.num_scheduled_tokens, plan.num_computed_tokens)  # (T,) each
        # Where each token sits in its request's cache: its position, or under DCP
        # its index among the tokens its owner stores (only the owner writes it).
        where = token_pos if self.shard is None else self.shard.local_position(token_pos)
        global_slots = token_slots(plan.block_tables, token_row, where, self.block_size)  # (T,)
        if self.shard is None:
            dcp = None
            context_slots = [
                to_dev(slots_of(plan.block_tables[r], np.arange(s), self.block_size))
                for r, s in zip(rows.req_idx.tolist(), rows.seq_lens.tolist())
            ]
        else:
            writes = writes & (self.shard.owner(token_pos) == self.rank)[token_of]
            all_to_all = self._pcp_group().all_to_all
            dcp = dcp_step(plan, layout, self.shard, self.block_size, self._prompt_lens(plan), all_to_all, to_dev)
            context_slots = []
        write_src = np.flatnonzero(writes)
        ctx = ForwardContext(
            query_start_loc=rows.query_start_loc.tolist(),
            start_pos=rows.start_pos.tolist(),
            seq_lens=rows.seq_lens.tolist(),
            context_slots=context_slots,
            write_src=None if writes.all() else to_dev(write_src),
            write_slots=to_dev(global_slots[token_of[write_src]]),
            kv_caches=self.kv_caches,
            kv_quant=self.kv_quant,
            gather=self._pcp_group().all_gather if gathers else None,
            dcp=dcp,
            prompt_lens=self._prompt_lens(plan)[rows.req_idx].tolist(),
        )
        input_ids = to_dev(plan.input_ids[rows.token_idx])
        extra = {}
        if plan.hidden_states is not None:  # the mtp layer: the target's state at each position
            extra["hidden"] = plan.hidden_states.to(self.device)[to_dev(rows.token_idx)]  # (n, H)
        forward = self.model.forward
        if self.compiled is not None and not extra and self.compiled.serves(ctx, len(input_ids)):
            forward = self.compiled.forward  # the same bits, without Python between the kernels
        if not led:
            hidden = forward(input_ids, to_dev(rows.positions), ctx, **extra)  # (n, H)
            return self._outputs_on_rank0(plan, layout, hidden, gathers)
        assert self.lead_threads is not None  # led
        torch.set_num_threads(self.lead_threads)
        try:
            hidden = forward(input_ids, to_dev(rows.positions), ctx, **extra)  # (n, H)
            out = self._outputs_on_rank0(plan, layout, hidden, gathers)
        finally:
            torch.set_num_threads(self.threads)
        self._share_led_kv(plan, global_slots)
        return out

    @staticmethod
    def _prompt_lens(plan: StepPlan) -> np.ndarray:
        """(R,) each row's prompt length: the plan's, or else a prefilling row's tokens all prompt."""
        if plan.num_prompt_tokens is not None:
            return plan.num_prompt_tokens
        computed = plan.num_computed_tokens
        return np.where(plan.is_prefilling, computed + plan.num_scheduled_tokens, computed)

    def _check_slots(self, plan: StepPlan) -> None:
        """Every slot the step reads or writes lies in this rank's cache: positions [0, c + q)
        of each row, or under DCP this rank's share of them."""
        seq_lens = plan.num_computed_tokens + plan.num_scheduled_tokens
        needed = seq_lens if self.shard is None else self.shard.local_len(seq_lens)
        check_block_tables(plan.block_tables, needed, self.block_size, self.kv_stack.shape[1] // self.block_size)

    def _split_ranks(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray] | None:
        """The policy's groups of ranks for this step's split rows (None: all ranks)."""
        policy = self.options.policy
        if policy is None or policy.pcp_size != self.pcp_size:  # P = 1, or fewer ranks left after a lost one
            return None
        q = plan.num_scheduled_tokens
        split = split_mask(q, plan.is_prefilling, self.options.pcp_min_tokens)
        return policy.split_ranks(q, plan.num_computed_tokens, split)

    def _pcp_group(self) -> PCPGroup:
        """The group, for the collectives of a step: only a step of several ranks has
        them (pcp_size > 1), and several ranks have a group."""
        assert self.group is not None
        return self.group

    def _share_led_kv(self, plan: StepPlan, slots: np.ndarray | None = None) -> None:
        """A led step's new KV, every layer's entries of every token, from rank 0's
        cache (at `slots` (T,), its tokens' slots in global order) into the others',
        so each still holds every token's KV."""
        if plan.num_tokens == 0:
            return

        def my_slots() -> np.ndarray:
            # Worked out only after the broadcast, on a core that rank 0's threads have left (it samples alone).
            row, pos = token_rows_positions(plan.num_scheduled_tokens, plan.num_computed_tokens)  # (T,) each
            return token_slots(plan.block_tables, row, pos, self.block_size)

        self._broadcast_kv(plan.num_tokens, slots, my_slots)

    @torch.inference_mode()  # the caches are inference tensors
    def copy_blocks(self, block_ids: np.ndarray) -> None:
        """Rank 0's KV of these blocks (every layer) into every other rank's cache, in
        bounded pieces (a long context's KV would otherwise be copied whole in memory)."""
        slots = (block_ids[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)  # (B * bs,)
        piece = max(self.block_size, COPY_SLOTS // self.block_size * self.block_size)
        for i in range(0, len(slots), piece):
            part = slots[i : i + piece]
            self._broadcast_kv(len(part), part, lambda: part)

    def _broadcast_kv(self, n: int, slots: np.ndarray | None, my_slots: Callable[[], np.ndarray]) -> None:
        """Every layer's cache entries at rank 0's ``slots`` (n,) into the other ranks'
        caches at ``my_slots()`` (n,): rank 0 sends, the others receive and store."""
        stack = self.kv_stack  # (layers, slots, *entry): every layer's entries of a slot in one op
        shape = (stack.shape[0], n, *stack.shape[2:])  # (layers, n, *entry)
        if self._led_buffer.numel() < math.prod(shape):  # reused: fresh pages each step cost more than the copy
            self._led_buffer = stack.new_empty(2 * math.prod(shape))
        entries = self._led_buffer[: math.prod(shape)].view(shape)
        if self.rank == 0:
            assert slots is not None  # rank 0 names what it sends
            torch.index_select(stack, 1, torch.from_numpy(slots).to(self.device), out=entries)
            self._pcp_group().broadcast_(entries)
            return
        self._pcp_group().broadcast_(entries)  # asleep until rank 0 has computed the step
        stack.index_copy_(1, torch.from_numpy(my_slots()).to(self.device), entries)

    def _outputs_on_rank0(
        self, plan: StepPlan, layout: PCPLayout, hidden: torch.Tensor, gathers: bool
    ) -> StepOutput | None:
        # The sampled tokens, every token of the rows that want prompt logprobs (a full
        # restore of those rows only, never of every token), and every token of the
        # hidden_rows, in global order.
        logit_idx, hidden_idx = plan.logits_token_indices(), plan.hidden_token_indices()  # (L,), (K,)
        wanted = np.union1d(logit_idx, hidden_idx) if len(hidden_idx) else logit_idx  # (W,) sorted
        where = layout.hidden_restore_idx[wanted]  # (W,) gathered position of the authoritative copy
        if not gathers:
            # Rank 0 holds every authoritative copy itself (gathered position == local index).
            if self.rank != 0:
                return None
            picked = hidden[torch.from_numpy(where).to(self.device)]  # (W, H)
            return self._output(picked, self.model.compute_logits(self._rows(picked, wanted, logit_idx)), wanted, plan)
        # Only the wanted tokens travel, each from the rank that computed it, to rank 0.
        group = self._pcp_group()
        n = layout.num_tokens_padded
        owner, local = where // n, where % n
        # The w-th wanted token is the index_in_rank-th of its owner's list, in global order;
        # width is rank-invariant, so every rank sends the same shape.
        index_in_rank, width = rank_order(owner, self.pcp_size)
        mine = local[owner == self.rank]
        send = hidden.new_zeros((width, hidden.shape[1]))
        send[: len(mine)] = hidden[torch.from_numpy(mine).to(self.device)]
        pick = torch.from_numpy(owner), torch.from_numpy(index_in_rank)
        parts = row_parts(self.model.logits_weight(), self.pcp_size) if group.one_host else None
        if parts is None:
            received = group.gather_to_first(send)  # rank 0: (P, width, H); others: None
            if received is None:
                return None
            picked = received[pick]  # (W, H)
            return self._output(picked, self.model.compute_logits(self._rows(picked, wanted, logit_idx)), wanted, plan)
        # Ranks sharing a host's memory bus each compute a range of the vocabulary for
        # every sampled token (reading 1/P of the lm_head), and rank 0 joins the ranges.
        picked = group.all_gather(send).view(self.pcp_size, width, -1)[pick]  # (W, H)
        sampled = self._rows(picked, wanted, logit_idx)  # (L, H)
        weight, lo, hi = parts[self.rank]
        widest = max(end - first for _, first, end in parts)
        logits = sampled.new_zeros((len(sampled), widest), dtype=torch.float32)
        logits[:, : hi - lo] = self.model.compute_logits(sampled, weight)
        received = group.gather_to_first(logits)  # rank 0: (P, L, widest)
        if received is None:
            return None
        joined = torch.cat([received[k, :, : end - first] for k, (_, first, end) in enumerate(parts)], dim=1)
        return self._output(picked, joined, wanted, plan)

    def _rows(self, picked: torch.Tensor, wanted: np.ndarray, indices: np.ndarray) -> torch.Tensor:
        """The rows of ``picked`` (W, H), the states of the ``wanted`` tokens, that hold ``indices``."""
        if len(indices) == len(wanted):
            return picked  # wanted is indices itself
        return picked[torch.from_numpy(np.searchsorted(wanted, indices)).to(self.device)]

    def _output(self, picked: torch.Tensor, logits: torch.Tensor, wanted: np.ndarray, plan: StepPlan) -> StepOutput:
        hidden_idx = plan.hidden_token_indices()
        return StepOutput(logits, self._rows(picked, wanted, hidden_idx) if len(hidden_idx) else None)
