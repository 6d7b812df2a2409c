"""What one step's sharded attention needs on this rank (attention/sharded.py).

Under DCP every query of the step is attended over every shard. On rank d a
query at position p sees its row's keys that rank d stores at positions up to
p: the first ``local_len(p + 1)`` of the rank's slots of the row, in position
order (ctxpar/parallel/dcp_shard.py). Which kernel it takes follows its
position, as at D = 1: a prompt position the prefill kernel (its row's prompt
queries in one call, a key count each), any other (a generated token, a draft)
the decode kernel (all of them in one call). A query the shard holds no key of
is left out: its partial stays empty (lse -inf). All of it follows from the
plan, the same for every layer of the step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ctxpar.layers.attention.backend import DecodeGroup
from ctxpar.layers.forward_context import DCPStep, ShardQueries
from ctxpar.layers.step_description import StepDescription, slots_of

ToDevice = Callable[[np.ndarray], torch.Tensor]  # an int64 array as a tensor on the rank's device


def dcp_step(step: StepDescription, to_dev: ToDevice) -> DCPStep:
    """The step's queries over this rank's shard (``step.shard``, not None); the
    step's all_to_all brings each rank its tokens' partials."""
    shard, layout, block_size = step.shard, step.layout, step.block_size
    assert shard is not None and step.all_to_all is not None  # under DCP, which has several ranks
    q, c = step.num_scheduled_tokens, step.num_computed_tokens
    qsl = np.concatenate(([0], np.cumsum(q)))
    _, pos = step.tokens  # (T,) each token's position
    counts = shard.local_len(pos + 1).astype(np.int64)  # (T,) keys of my shard each token sees
    prompt_end = qsl[:-1] + np.clip(step.prompt_lens - c, 0, q)  # (R,) the token after each row's prompt queries
    prompt: list[ShardQueries] = []
    generated: list[ShardQueries] = []
    decode_slots: list[np.ndarray] = []  # each generated query's slots, back to back: the decode kernel's input

    def span(a: int, b: int, row_slots: torch.Tensor) -> ShardQueries | None:
        """The row's tokens [a, b) but those before my shard's first key of the row."""
        a += int(np.count_nonzero(counts[a:b] == 0))
        return ShardQueries(a, b, row_slots[: counts[b - 1]], to_dev(counts[a:b])) if b > a else None

    for r in np.flatnonzero(q):
        slots = slots_of(step.block_tables[r], np.arange(counts[qsl[r + 1] - 1]), block_size)  # the row's, mine
        on_dev = to_dev(slots)
        if (p := span(int(qsl[r]), int(prompt_end[r]), on_dev)) is not None:
            prompt.append(p)
        if (g := span(int(prompt_end[r]), int(qsl[r + 1]), on_dev)) is not None:
            generated.append(g)
            decode_slots += [slots[:k] for k in counts[g.start : g.end]]
    decodes = None
    if generated:
        tokens = np.concatenate([np.arange(g.start, g.end) for g in generated])
        starts = np.concatenate(([0], np.cumsum(counts[tokens])))
        decodes = DecodeGroup(to_dev(tokens), to_dev(np.concatenate(decode_slots)), to_dev(starts))
    return DCPStep(
        query_idx=to_dev(layout.hidden_restore_idx),
        prompt=prompt,
        generated=generated,
        decodes=decodes,
        send_idx=to_dev(np.where(layout.gathered_is_padding, layout.num_tokens, layout.padded_gather_idx)).view(
            shard.size, -1
        ),
        all_to_all=step.all_to_all,
    )
