"""StepSampler: a step's logits become its tokens, in vLLM's order, all or nothing.

The executor returns logits for the rows that sample and, where the plan asks
(``StepPlan.all_logits``), for every position of a row: a verify row's (one
per draft, plus the bonus) or a row computing prompt logprobs. Then, on rank 0:

1. grammar masks: each constrained row's disallowed tokens go to -inf before
   anything reads the row (its logprobs, penalties and draw all see the mask);
2. verification: each verify row keeps its accepted drafts and one more
   token (rejection.py);
3. sampling: every other row that reached the end of its known tokens draws
   its next token (sampler.py);

and the prompt logprobs are read from their rows (prompt_logprobs.py).

Drafts and samples draw from the requests' own generators. A step that fails,
anywhere from drafting to sampling, must leave every generator where it was:
``restoring_rng`` saves their states before the step draws and restores them
if it raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ctxpar.engine.request import Request
from ctxpar.engine.sample.prompt_logprobs import PromptChunk, split_logits
from ctxpar.engine.sample.rejection import DraftProbs, Verified, verify_drafts
from ctxpar.engine.sample.sampler import Sampler
from ctxpar.engine.sample.structured_output import StructuredOutputs
from ctxpar.outputs import LogprobsOnePosition
from ctxpar.worker.step_plan import StepPlan


@dataclass
class SampledStep:
    """What a step's logits gave (for Scheduler.update_from_output and the OutputProcessor)."""

    sampling: list[Request]  # the rows that sampled one token, in row order
    token_ids: list[int]  # the token each drew
    logprobs: list[LogprobsOnePosition | None]  # each one's logprobs; None where not wanted
    verified: list[Verified]  # the verify rows' tokens, in row order
    prompt_chunks: list[PromptChunk]  # the prompt logprobs the step computed


class GeneratorStates:
    """The saved states of the generators a step may draw from."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # by generator id

    def save(self, requests: Iterable[Request]) -> None:
        """Save the states of the requests' generators not saved yet."""
        for r in requests:
            if r.generator is not None:
                self._saved.setdefault(id(r.generator), (r.generator, r.generator.get_state()))

    def restore(self) -> None:
        """Put every saved generator back where it was."""
        for g, state in self._saved.values():
            g.set_state(state)


class StepSampler:
    """Masks, verifies and samples a step's logits, and keeps the requests' RNG states
    across a step that may fail."""

    def __init__(self, structured: StructuredOutputs, draft_probs: DraftProbs | None = None) -> None:
        """structured: the engine's constrained decoding (its grammars mask rows);
        draft_probs: the distributions a draft model drew a request's drafts from."""
        self.structured = structured
        self.draft_probs = draft_probs
        self.sampler = Sampler()

    @contextmanager
    def restoring_rng(self, requests: Iterable[Request]) -> Iterator[GeneratorStates]:
        """Save the states of the requests' generators (and of those given to the
        yielded ``save`` later); if the block raises (anything, KeyboardInterrupt
        included), restore them all before the exception goes on."""
        states = GeneratorStates()
        states.save(requests)
        try:
            yield states
        except BaseException:
            states.restore()
            raise

    def sample(self, requests: list[Request], plan: StepPlan, logits: torch.Tensor) -> SampledStep:
        """The tokens of a step's rows (row i: requests[i]) from its logits, which follow
        ``plan.logits_token_indices()``. Only the generators advance: the scheduler records
        the tokens (Scheduler.update_from_output)."""
        sampling = [r for r, need in zip(requests, plan.needs_logits) if need and not r.spec_token_ids]
        verifying = [r for r in requests if r.spec_token_ids]
        sample_rows, prompt_chunks, verify_starts = split_logits(requests, plan, logits)
        sample_logits = logits if sample_rows is None else logits[sample_rows]
        self.structured.mask(sample_logits, sampling)
        verified = verify_drafts(verifying, logits, verify_starts, self.draft_probs)
        out = self.sampler(
            sample_logits,
            [r.params for r in sampling],
            [r.generator for r in sampling],
            sampling,
            [r.cumulative_logprob is not None for r in sampling],  # best_of ranks samples by it
        )
        return SampledStep(sampling, out.token_ids, out.logprobs, verified, prompt_chunks)
