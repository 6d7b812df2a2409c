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

A layer with a sliding window of w keys sees, of those, only the keys at positions
(p - w, p]: on rank d a run of its slots, from the first ``local_len(p + 1 - w)``
on (``ShardQueries.firsts``; its decode rows hold only that run). A shard holding
no key of a query's window sends an empty partial, as above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache

import numpy as np
import torch

from ctxpar.layers.attention.backend import KEY_BLOCK_ALIGN, DecodeGroup
from ctxpar.layers.forward_context import DCPStep, ShardQueries
from ctxpar.layers.step_description import StepDescription, slots_of

ToDevice = Callable[[np.ndarray], torch.Tensor]  # an int64 array as a tensor on the rank's device


def dcp_step(step: StepDescription, to_dev: ToDevice) -> DCPStep:
    """The step's queries over this rank's shard (``step.shard``, not None); the
    step's all_to_all brings each rank its tokens' partials. Its ``windowed(w)`` is
    the same step as a layer with a sliding window of w keys attends it, built on
    first use, once per window."""
    assert step.shard is not None and step.all_to_all is not None  # under DCP, which has several ranks
    prompt, generated, decodes = _queries(step, to_dev, None)
    base = DCPStep(
        query_idx=to_dev(step.layout.hidden_restore_idx),
        prompt=prompt,
        generated=generated,
        decodes=decodes,
        send_idx=to_dev(
            np.where(step.layout.gathered_is_padding, step.layout.num_tokens, step.layout.padded_gather_idx)
        ).view(step.shard.size, -1),
        all_to_all=step.all_to_all,
    )

    @cache
    def windowed(window: int) -> DCPStep:
        prompt, generated, decodes = _queries(step, to_dev, window)
        return dataclasses.replace(base, prompt=prompt, generated=generated, decodes=decodes)

    base.windowed = windowed
    return base


def _queries(
    step: StepDescription, to_dev: ToDevice, window: int | None
) -> tuple[list[ShardQueries], list[ShardQueries], DecodeGroup | None]:
    """The step's prompt and generated queries over my shard, row by row, and the
    generated ones as one decode group; with a window, each query from the first of
    my keys inside it: the keys at positions (p - window, p] are a run of my slots."""
    shard, block_size = step.shard, step.block_size
    assert shard is not None
    q, c = step.num_scheduled_tokens, step.num_computed_tokens
    qsl = np.concatenate(([0], np.cumsum(q)))
    _, pos = step.tokens  # (T,) each token's position
    counts = shard.local_len(pos + 1).astype(np.int64)  # (T,) keys of my shard each token sees
    # (T,) my keys before each token's window: a query left none (firsts == counts) gets an empty partial
    firsts = None if window is None else shard.local_len(np.maximum(pos + 1 - window, 0)).astype(np.int64)
    prompt_end = qsl[:-1] + np.clip(step.prompt_lens - c, 0, q)  # (R,) the token after each row's prompt queries
    prompt: list[ShardQueries] = []
    generated: list[ShardQueries] = []
    decode_slots: list[np.ndarray] = []  # each generated query's slots, back to back: the decode kernel's input

    def span(a: int, b: int, row_slots: torch.Tensor) -> ShardQueries | None:
        """The row's tokens [a, b) but those before my shard's first key of the row; with a
        window, the row's slots from the run of KEY_BLOCK_ALIGN before the first query's window
        (firsts grow with the position): the kernel's blocks, and bits, as over all of them."""
        a += int(np.count_nonzero(counts[a:b] == 0))
        if b <= a:
            return None
        if firsts is None:
            return ShardQueries(a, b, row_slots[: counts[b - 1]], to_dev(counts[a:b]))
        lo = min(int(firsts[a]), int(counts[a]) - 1) // KEY_BLOCK_ALIGN * KEY_BLOCK_ALIGN  # each count stays >= 1
        return ShardQueries(a, b, row_slots[lo : counts[b - 1]], to_dev(counts[a:b] - lo), to_dev(firsts[a:b] - lo))

    for r in np.flatnonzero(q):
        slots = slots_of(step.block_tables[r], np.arange(counts[qsl[r + 1] - 1]), block_size)  # the row's, mine
        on_dev = to_dev(slots)
        if (p := span(int(qsl[r]), int(prompt_end[r]), on_dev)) is not None:
            prompt.append(p)
        if (g := span(int(prompt_end[r]), int(qsl[r + 1]), on_dev)) is not None:
            generated.append(g)
            ends = counts[g.start : g.end]
            starts = np.zeros_like(ends) if firsts is None else firsts[g.start : g.end]
            decode_slots += [slots[f:k] for f, k in zip(starts, ends)]
    decodes = None
    if generated:
        tokens = np.concatenate([np.arange(g.start, g.end) for g in generated])
        lengths = np.array([len(s) for s in decode_slots], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths)))
        decodes = DecodeGroup(to_dev(tokens), to_dev(np.concatenate(decode_slots)), to_dev(starts))
    return prompt, generated, decodes
