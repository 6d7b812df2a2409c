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
import torch


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
    # Run on the draft model (speculative decoding's draft_model or mtp), with its own KV
    # cache at the same block ids, instead of the target model.
    draft: bool = False
    # (R,) bool, or None for all False: rank 0 also gets the final hidden state of every
    # token of the row (the target's states feed the mtp draft layer).
    hidden_rows: np.ndarray | None = None
    # (T, H) per-token input hidden states for a model that takes them (the mtp layer: the
    # target's state at each position), or None.
    hidden_states: torch.Tensor | None = None
    # (R,) int64 the prompt length of each row's request, or None (then a prefilling row's
    # tokens all count as prompt, a decode row's as generated). Attention picks a query's
    # kernel by it: a prompt position always takes the prefill kernel and a generated one
    # the decode kernel, however the row is chunked, cached or recomputed.
    num_prompt_tokens: np.ndarray | None = None

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

    def hidden_token_indices(self) -> np.ndarray:
        """(K,) int64 global flat indices of every token of the ``hidden_rows`` rows, in order."""
        if self.hidden_rows is None or not self.hidden_rows.any():
            return np.zeros(0, dtype=np.int64)
        ends = np.cumsum(self.num_scheduled_tokens)
        starts = ends - self.num_scheduled_tokens
        return np.concatenate([np.arange(a, b) for a, b in zip(starts[self.hidden_rows], ends[self.hidden_rows])])

    def __post_init__(self) -> None:
        if int(self.num_scheduled_tokens.sum()) != len(self.input_ids):
            raise ValueError("StepPlan: input_ids length must equal the sum of num_scheduled_tokens")
        # Every row computes at least one token, so "the rows with needs_logits" means the
        # same rows to the runner (which returns their logits) and the engine (which samples them).
        if self.num_rows == 0 or self.num_scheduled_tokens.min() < 1:
            raise ValueError("StepPlan: every row must schedule at least one token")


@dataclass(frozen=True)
class StepOutput:
    """What rank 0 gets back from a step."""

    logits: torch.Tensor  # (L, vocab) float32, of plan.logits_token_indices()
    hidden: torch.Tensor | None = None  # (K, H) final hidden states of plan.hidden_token_indices(), if any


@dataclass(frozen=True)
class KVCopy:
    """A message of rank 0 besides step plans: copy rank 0's KV of these blocks (every
    layer of every model's cache) into every other rank's. After a lost rank was
    respawned, this restores its cache where every rank holds the whole cache."""

    block_ids: np.ndarray  # (B,) int64
