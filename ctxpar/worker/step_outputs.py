"""What rank 0 gets back from a step: the final states of the tokens it asked
for, each from the rank that computed its authoritative copy, and their logits.

Every rank calls ``outputs_on_rank0`` with the same plan and layout, so all of
them enter the same collectives with the same shapes; only the wanted tokens
travel, never every token's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ctxpar.layers.linear import Weight, row_parts
from ctxpar.layers.step_description import StepDescription
from ctxpar.models.base import CausalLM
from ctxpar.parallel.comm import PCPGroup
from ctxpar.worker.step_inputs import rank_order
from ctxpar.worker.step_plan import StepOutput, StepPlan

Pick = tuple[torch.Tensor, torch.Tensor]  # (rank, index) of each wanted token among what the ranks send


class Wanted(NamedTuple):
    """The tokens whose final states rank 0 needs from a step, as global flat indices:
    the sampled tokens and every token of the rows that want prompt logprobs (a full
    restore of those rows only, never of every token), and every token of the
    hidden_rows."""

    logits: np.ndarray  # (L,) plan.logits_token_indices()
    hidden: np.ndarray  # (K,) plan.hidden_token_indices()
    tokens: np.ndarray  # (W,) both, sorted

    @classmethod
    def of(cls, plan: StepPlan) -> Wanted:
        logits, hidden = plan.logits_token_indices(), plan.hidden_token_indices()
        return cls(logits, hidden, np.union1d(logits, hidden) if len(hidden) else logits)


def outputs_on_rank0(
    model: CausalLM, plan: StepPlan, step: StepDescription, hidden: torch.Tensor, group: PCPGroup | None
) -> StepOutput | None:
    """Rank 0's StepOutput (None on the other ranks), from every rank's hidden states
    of its local tokens (``hidden``, (n, H) on this one); group: the ranks', None
    for one rank."""
    wanted = Wanted.of(plan)
    where = step.layout.hidden_restore_idx[wanted.tokens]  # (W,) gathered position of the authoritative copy
    if not step.gathers:
        # Rank 0 holds every authoritative copy itself (gathered position == local index).
        if step.rank != 0:
            return None
        return _output(model, wanted, hidden[torch.from_numpy(where).to(hidden.device)])
    assert group is not None  # a step that gathers has several ranks
    send, pick = _wanted_of_mine(hidden, where, step.layout.num_tokens_padded, step.rank, group.size)
    parts = row_parts(model.logits_weight(), group.size) if group.one_host else None
    if parts is not None:
        return _logits_by_vocab_range(model, group, wanted, send, pick, parts)
    received = group.gather_to_first(send)  # rank 0: (P, width, H); others: None
    return _output(model, wanted, received[pick]) if received is not None else None


def _wanted_of_mine(
    hidden: torch.Tensor, where: np.ndarray, n: int, rank: int, ranks: int
) -> tuple[torch.Tensor, Pick]:
    """What ``rank`` sends of the wanted tokens, at gathered positions ``where`` (W,)
    of n a rank: the states of those it computed, (width, H) padded to a width
    every rank shares; and where each wanted token is among what the ranks send."""
    owner, local = where // n, where % n
    # The w-th wanted token is the index_in_rank-th of its owner's list, in global order;
    # width is rank-invariant, so every rank sends the same shape.
    index_in_rank, width = rank_order(owner, ranks)
    mine = local[owner == rank]
    send = hidden.new_zeros((width, hidden.shape[1]))
    send[: len(mine)] = hidden[torch.from_numpy(mine).to(hidden.device)]
    return send, (torch.from_numpy(owner), torch.from_numpy(index_in_rank))


def _logits_by_vocab_range(
    model: CausalLM,
    group: PCPGroup,
    wanted: Wanted,
    send: torch.Tensor,
    pick: Pick,
    parts: Sequence[tuple[Weight, int, int]],
) -> StepOutput | None:
    """Ranks sharing a host's memory bus each compute a range of the vocabulary for
    every sampled token (reading 1/P of the lm_head, cut into ``parts``), and rank
    0 joins the ranges."""
    picked = group.all_gather(send).view(group.size, len(send), -1)[pick]  # (W, H)
    sampled = _rows(picked, wanted, wanted.logits)  # (L, H)
    weight, lo, hi = parts[group.rank]
    widest = max(end - first for _, first, end in parts)
    logits = sampled.new_zeros((len(sampled), widest), dtype=torch.float32)
    logits[:, : hi - lo] = model.compute_logits(sampled, weight)
    received = group.gather_to_first(logits)  # rank 0: (P, L, widest)
    if received is None:
        return None
    joined = torch.cat([received[k, :, : end - first] for k, (_, first, end) in enumerate(parts)], dim=1)
    return _output(model, wanted, picked, joined)


def _rows(picked: torch.Tensor, wanted: Wanted, indices: np.ndarray) -> torch.Tensor:
    """The rows of ``picked`` (W, H), the states of the wanted tokens, that hold ``indices``."""
    if len(indices) == len(wanted.tokens):
        return picked  # wanted is indices itself
    return picked[torch.from_numpy(np.searchsorted(wanted.tokens, indices)).to(picked.device)]


def _output(model: CausalLM, wanted: Wanted, picked: torch.Tensor, logits: torch.Tensor | None = None) -> StepOutput:
    """Rank 0's result from the wanted tokens' states ``picked`` (W, H): their logits
    (computed here unless the ranks computed them by vocabulary range) and the
    hidden rows' states."""
    if logits is None:
        logits = model.compute_logits(_rows(picked, wanted, wanted.logits))
    hidden = _rows(picked, wanted, wanted.hidden) if len(wanted.hidden) else None
    return StepOutput(logits, hidden)
