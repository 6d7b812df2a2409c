"""The step plan: everything a rank needs to run one step, and nothing more.

Rank 0's scheduler produces it; the control plane sends it to every rank; every
model runner (rank 0's included) turns it into the same global batch and the
same PCP layout. Ranks keep no request state of their own, so they can never
disagree about it: each prompt token travels once (in the step that computes
it), each sampled token once (in the step that decodes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepPlan:
    input_ids: np.ndarray  # (T,) int64 tokens computed this step, rows concatenated
    num_scheduled_tokens: np.ndarray  # (R,) int64 q_r
    num_computed_tokens: np.ndarray  # (R,) int64 c_r: tokens already in the KV cache
    is_prefilling: np.ndarray  # (R,) bool: prompt (or recompute) rows; False for decodes
    needs_logits: np.ndarray  # (R,) bool: the row's last token is sampled this step
    block_tables: list[np.ndarray]  # R x (num_blocks_r,) int64 KV block ids of each row
    # (R,) bool, or None for all False: the row wants the logits of every token it computes
    # (prompt logprobs), not only of its last one.
    all_logits: np.ndarray | None = None
    # Run on the draft model (speculative decoding's draft_model), with its own KV cache
    # at the same block ids, instead of the target model.
    draft: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def logits_token_indices(self) -> np.ndarray:
        """(L,) int64 global flat indices of the tokens whose logits the runner returns,
        in order: every token of an ``all_logits`` row, the last token of any other
        row with ``needs_logits``."""
        ends = np.cumsum(self.num_scheduled_tokens)
        if self.all_logits is None or not self.all_logits.any():
            return ends[self.needs_logits] - 1
        lengths = np.where(self.all_logits, self.num_scheduled_tokens, self.needs_logits.astype(np.int64))
        starts = ends - lengths
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        return np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])

    def __post_init__(self) -> None:
        if int(self.num_scheduled_tokens.sum()) != len(self.input_ids):
            raise ValueError("StepPlan: input_ids length must equal the sum of num_scheduled_tokens")
        # Every row computes at least one token, so "the rows with needs_logits" means the
        # same rows to the runner (which returns their logits) and the engine (which samples them).
        if self.num_rows == 0 or self.num_scheduled_tokens.min() < 1:
            raise ValueError("StepPlan: every row must schedule at least one token")
