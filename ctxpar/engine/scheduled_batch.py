"""What one ``Scheduler.schedule()`` decides: the StepPlan the ranks run and the request of each row."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ctxpar.engine.block_manager import BlockManager
from ctxpar.engine.request import Request
from ctxpar.engine.sample.prompt_logprobs import wants_prompt_logits
from ctxpar.worker.step_plan import StepPlan


@dataclass
class ScheduledBatch:
    """A step plan plus, per row, the request it computes."""

    plan: StepPlan
    requests: list[Request]
    preempted: list[Request] = field(default_factory=list)


def build_plan(rows: list[tuple[Request, int]], block_manager: BlockManager) -> StepPlan:
    """The StepPlan of ``rows``: (request, tokens it computes from its num_computed_tokens on)."""
    n = len(rows)
    q_arr = np.empty(n, dtype=np.int64)
    c_arr = np.empty(n, dtype=np.int64)
    is_prefilling = np.empty(n, dtype=bool)
    prompt = np.empty(n, dtype=np.int64)
    needs_logits = np.empty(n, dtype=bool)
    all_logits = np.empty(n, dtype=bool)
    ids: list[int] = []
    tables: list[np.ndarray] = []
    for i, (req, q) in enumerate(rows):
        c = req.num_computed_tokens
        q_arr[i], c_arr[i], prompt[i] = q, c, req.num_prompt_tokens
        ids.extend(req.token_ids(c, min(c + q, req.num_tokens)))
        ids.extend(req.spec_token_ids)  # a verify row: the last known token, then the drafts
        # A decode: one token, everything before it cached, prompt done. A verify row
        # (1 + k tokens) is laid out across the ranks by the rules of any other row.
        is_prefilling[i] = not (q == 1 and c == req.num_tokens - 1 and c >= req.num_prompt_tokens)
        # Sample only when the chunk reaches the end of the known tokens (and drafts).
        needs_logits[i] = c + q == req.num_tokens + len(req.spec_token_ids)
        # Every position's logits: a verify row's (one per draft, plus the bonus), and those of
        # a row computing prompt positions whose logprobs are still missing.
        all_logits[i] = bool(req.spec_token_ids) or wants_prompt_logits(req)
        tables.append(np.asarray(block_manager.block_table(req.request_id), dtype=np.int64))
    return StepPlan(
        input_ids=np.asarray(ids, dtype=np.int64),
        num_scheduled_tokens=q_arr,
        num_computed_tokens=c_arr,
        is_prefilling=is_prefilling,
        num_prompt_tokens=prompt,
        needs_logits=needs_logits,
        block_tables=tables,
        all_logits=all_logits if all_logits.any() else None,
    )
