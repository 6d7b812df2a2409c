"""ModelRunner: one rank's share of every step.

Every rank (rank 0 included) runs the same code on the same StepPlan:

    StepPlan ──► PCP layout (pure, identical on all ranks) ──► StepDescription
             ──► its attention metadata, this rank's rows and where their KV
                 lives (layers/attention_metadata.py) ──► ForwardContext
             ──► model forward (each attention layer: gather KV over ranks,
                 write the cache, attend)
             ──► hidden states of the sampled tokens reach rank 0 ──► logits

The runner only schedules that work; what attention needs of a step is
decided next to attention, from the StepDescription.

Any branch that leads into a collective is decided from the plan and the
layout alone, which every rank has, so all ranks always enter the same
collectives with the same shapes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import torch

from ctxpar.kernels.huge_pages import KV_AHEAD, FaultIn
from ctxpar.layers.attention_metadata import AttentionMetadataBuilder
from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.kv_quant import KVQuant
from ctxpar.layers.step_description import StepDescription
from ctxpar.models.base import CausalLM, FastDecode, FastDecodeStep
from ctxpar.parallel.comm import PCPGroup
from ctxpar.parallel.dcp_shard import DCPShard
from ctxpar.parallel.pcp import plan_pcp_layout, split_mask
from ctxpar.worker.graph_runner import DecodeGraphs
from ctxpar.worker.kv_cache_allocation import allocate_kv_caches
from ctxpar.worker.options import RunnerOptions
from ctxpar.worker.step_inputs import check_block_tables
from ctxpar.worker.step_outputs import outputs_on_rank0
from ctxpar.worker.step_plan import StepOutput, StepPlan

COPY_SLOTS = 1024  # cache slots per piece of a KV copy (copy_blocks): what a led step of 1K tokens holds

log = logging.getLogger(__name__)
_SAID_LACKING: set[str] = set()  # model classes this process has said have no fast decode step


def fast_decode_of(model: CausalLM) -> FastDecodeStep | None:
    """The model's fast decode paths (``CausalLM.fast_decode``), or None for a model
    without the hook, which is said once per class: its decodes run its forward."""
    hook = getattr(model, "fast_decode", None)
    if hook is not None:
        return hook()
    name = type(model).__name__
    if name not in _SAID_LACKING:
        _SAID_LACKING.add(name)
        log.info("%s has no fast decode step (CausalLM.fast_decode): its decode steps run its forward", name)
    return None


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
        # On the CPU its pages are made on idle CPUs ahead of the blocks the steps reach (_check_slots).
        self.fault_in = FaultIn.of(self.kv_stack, model.num_kv_layers, KV_AHEAD)
        self.metadata = AttentionMetadataBuilder(self.kv_caches, self.kv_quant, device)
        # Steps of decodes through the model's fast decode step, where it has one (enforce_eager:
        # never): one compiled call on the CPU, replays of CUDA graphs on a GPU.
        self.compiled: FastDecode | None = None
        self.graphs: DecodeGraphs | None = None
        fast = None if options.enforce_eager else fast_decode_of(model)
        if fast is not None:
            self.compiled = fast.compile(self.kv_caches, self.kv_quant)  # None off the CPU: it reads CPU caches
            capacity = options.num_blocks * options.block_size
            context = min(options.max_model_len or capacity, capacity)
            self.graphs = DecodeGraphs.build(  # None on the CPU: build touches no GPU there
                model,
                fast.shape,
                self.kv_caches,
                self.kv_quant,
                options.max_num_seqs,
                context,
                options.block_size,
                device,
            )

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
        step = self._describe(plan)
        if self.graphs is not None and self.group is None:
            graph = self.graphs.graph_for(plan)
            if graph is not None:  # decodes only, on one GPU: one replay (worker/graph_runner.py)
                return outputs_on_rank0(self.model, plan, step, self.graphs.forward(plan, graph), None)
        led = self.lead_threads is not None and not step.gathers
        if led and self.rank != 0:  # rank 0 computes this step alone; this rank stores its new KV
            self._share_led_kv(step)
            return None
        ctx = self.metadata.build(step)
        if led:
            return self._lead(plan, step, ctx)
        return outputs_on_rank0(self.model, plan, step, self._forward(plan, step, ctx), self.group)

    def _describe(self, plan: StepPlan) -> StepDescription:
        """The step as attention sees it: the plan's rows, their PCP layout (pure,
        identical on all ranks) and this rank's place."""
        layout = plan_pcp_layout(
            plan.num_scheduled_tokens,
            plan.num_computed_tokens,
            plan.is_prefilling,
            self.pcp_size,
            replicate_below=self.options.pcp_min_tokens,
            spread_min_rows=self.spread_min_rows,
            split_ranks=self._split_ranks(plan),
        )
        group = self.group  # its collectives run only in a step of several ranks (one that gathers, or DCP)
        return StepDescription(
            num_scheduled_tokens=plan.num_scheduled_tokens,
            num_computed_tokens=plan.num_computed_tokens,
            prompt_lens=self._prompt_lens(plan),
            block_tables=plan.block_tables,
            block_size=self.block_size,
            layout=layout,
            rank=self.rank,
            shard=self.shard,
            all_gather=group.all_gather if group is not None else None,
            all_to_all=group.all_to_all if group is not None else None,
        )

    def _forward(self, plan: StepPlan, step: StepDescription, ctx: ForwardContext) -> torch.Tensor:
        """The model over this rank's rows of the step: their (n, H) hidden states."""
        rows = step.rows
        input_ids = self._to_device(plan.input_ids[rows.token_idx])
        extra = {}
        if plan.hidden_states is not None:  # the mtp layer: the target's state at each position
            extra["hidden"] = plan.hidden_states.to(self.device)[self._to_device(rows.token_idx)]  # (n, H)
        forward = self.model.forward
        if self.compiled is not None and not extra and self.compiled.serves(ctx, len(input_ids)):
            forward = self.compiled.forward  # the same bits, without Python between the kernels
        return forward(input_ids, self._to_device(rows.positions), ctx, **extra)

    def _lead(self, plan: StepPlan, step: StepDescription, ctx: ForwardContext) -> StepOutput | None:
        """A led step on rank 0: computed alone with the ranks' threads together, then
        its new KV sent to the others."""
        assert self.lead_threads is not None  # only ranks sharing a host lead
        torch.set_num_threads(self.lead_threads)
        try:
            out = outputs_on_rank0(self.model, plan, step, self._forward(plan, step, ctx), self.group)
        finally:
            torch.set_num_threads(self.threads)
        self._share_led_kv(step)
        return out

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """An int64 array as a tensor on the rank's device."""
        return torch.tensor(a, dtype=torch.int64, device=self.device)

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
        num_blocks = self.kv_stack.shape[1] // self.block_size
        top = check_block_tables(plan.block_tables, needed, self.block_size, num_blocks)
        if self.fault_in is None:
            return
        if top == num_blocks - 1:  # the cache's last block: a window's null block (never written) or a real one
            ids = np.concatenate(plan.block_tables)
            top = int(ids[ids < top].max(initial=-1))
        self.fault_in.advance((top + 1) * self.block_size)

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

    def _share_led_kv(self, step: StepDescription) -> None:
        """A led step's new KV, every layer's entries of every token, from rank 0's
        cache into the others' (at each token's slot), so each still holds every
        token's KV. The others work their slots out only after the broadcast, on a
        core that rank 0's threads have left (it samples alone)."""
        self._broadcast_kv(step.num_tokens, lambda: step.slots)

    @torch.inference_mode()  # the caches are inference tensors
    def copy_blocks(self, block_ids: np.ndarray) -> None:
        """Rank 0's KV of these blocks (every layer) into every other rank's cache, in
        bounded pieces (a long context's KV would otherwise be copied whole in memory)."""
        slots = (block_ids[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)  # (B * bs,)
        piece = max(self.block_size, COPY_SLOTS // self.block_size * self.block_size)
        for i in range(0, len(slots), piece):
            part = slots[i : i + piece]
            self._broadcast_kv(len(part), lambda: part)

    def _broadcast_kv(self, n: int, slots: Callable[[], np.ndarray]) -> None:
        """Every layer's cache entries at ``slots()`` (n,) of rank 0 into the same slots
        of the other ranks: rank 0 sends, the others receive and store (and call
        ``slots`` only once they have received)."""
        stack = self.kv_stack  # (layers, slots, *entry): every layer's entries of a slot in one op
        shape = (stack.shape[0], n, *stack.shape[2:])  # (layers, n, *entry)
        if self._led_buffer.numel() < math.prod(shape):  # reused: fresh pages each step cost more than the copy
            self._led_buffer = stack.new_empty(2 * math.prod(shape))
        entries = self._led_buffer[: math.prod(shape)].view(shape)
        if self.rank == 0:
            torch.index_select(stack, 1, torch.from_numpy(slots()).to(self.device), out=entries)
            self._pcp_group().broadcast_(entries)
            return
        self._pcp_group().broadcast_(entries)  # asleep until rank 0 has computed the step
        stack.index_copy_(1, torch.from_numpy(slots()).to(self.device), entries)
