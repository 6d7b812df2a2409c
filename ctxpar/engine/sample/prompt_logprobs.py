"""Prompt logprobs: which rows return every token's logits, and what they give.

A request with ``prompt_logprobs`` has its first sample compute the whole
prompt (no prefix-cache reads); each step that computes prompt positions
still missing asks the runner for the logits of every token of its row
(``StepPlan.all_logits``), not only the last. Position p's logits give the
entry of prompt token p + 1; entry 0 is None (vLLM's shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxpar.engine.request import Request, RequestGroup
from ctxpar.engine.sample.sampler import logprobs_of
from ctxpar.outputs import Logprob
from ctxpar.worker.step_plan import StepPlan


@dataclass
class PromptChunk:
    """The prompt logprobs one step computed for one request."""

    group: RequestGroup
    first_pos: int  # the prompt position of entries[0]
    entries: list[dict[int, Logprob]]


def wants_prompt_logits(req: Request) -> bool:
    """Whether this step's row of ``req`` computes prompt positions whose logprobs are still missing
    (read before commit: num_computed_tokens is the row's first position)."""
    group = req.group  # None only for a request scheduled without the engine (the scheduler's tests)
    return (
        group is not None
        and req.index == 0
        and group.wants_prompt_logprobs
        and req.num_computed_tokens < req.num_prompt_tokens - 1
    )


def split_logits(
    requests: list[Request], plan: StepPlan, logits: torch.Tensor
) -> tuple[list[int] | None, list[PromptChunk], list[int]]:
    """The logits rows that sample (None: all of them, in order), the prompt
    logprobs of the ``all_logits`` rows, and where each verify row's logits start
    (rows with speculative drafts, in order); ``logits`` follows plan.logits_token_indices()."""
    if plan.all_logits is None:
        return None, [], []
    sample_rows: list[int] = []
    verify_starts: list[int] = []
    chunks = []
    at = 0
    for req, q, need, every in zip(requests, plan.num_scheduled_tokens.tolist(), plan.needs_logits, plan.all_logits):
        if every and req.spec_token_ids:  # a decode row: never a prompt position
            verify_starts.append(at)
            at += q
        elif every:
            # The row wants prompt logprobs (wants_prompt_logits): it has a group and asked for them.
            assert req.group is not None and req.params.prompt_logprobs is not None
            c = int(req.num_computed_tokens)
            k = max(0, min(c + q, req.num_prompt_tokens - 1) - c)  # positions that predict a prompt token
            nxt = req.prompt_token_ids[c + 1 : c + 1 + k]
            entries = logprobs_of(logits[at : at + k].cpu(), nxt, req.params.prompt_logprobs) if k else []
            chunks.append(PromptChunk(req.group, c + 1, entries))
            at += q
            if need:
                sample_rows.append(at - 1)
        elif need:
            sample_rows.append(at)
            at += 1
    return sample_rows, chunks, verify_starts


def new_entries(chunk: PromptChunk) -> list[dict[int, Logprob]]:
    """The chunk's entries the group does not have yet (a chunk recomputed after a preemption adds nothing)."""
    assert chunk.group.prompt_logprobs is not None  # the chunk's group wants prompt logprobs
    have = len(chunk.group.prompt_logprobs)
    return chunk.entries[max(0, have - chunk.first_pos) :] if chunk.first_pos <= have else []
