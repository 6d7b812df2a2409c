"""What becomes of each new token (vLLM's OutputProcessor): its metrics, logprobs (with
their text), the request's detokenized text and stop conditions; a step's prompt
logprobs; and the RequestOutputs of the request groups a step advanced."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from ctxpar.engine.detokenizer import IncrementalDetokenizer
from ctxpar.engine.request import Request, RequestGroup
from ctxpar.engine.sample.prompt_logprobs import PromptChunk, new_entries
from ctxpar.outputs import CompletionOutput, Logprob, RequestOutput


class OutputProcessor:
    """Turns a step's tokens into text, logprobs, finished requests and RequestOutputs."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int]) -> None:
        """eos_token_ids: where generation stops unless ignore_eos (LLM may add a tokenizer's)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._token_texts: dict[int, str] = {}  # decoded_token of logprobs, decoded once per token id

    def with_text(self, lps: dict[int, Logprob], detokenize: bool) -> dict[int, Logprob]:
        """Fill in each Logprob's decoded_token (the token decoded on its own, as vLLM)."""
        if self.tokenizer is not None and detokenize:
            for t, lp in lps.items():
                text = self._token_texts.get(t)
                if text is None:
                    text = self._token_texts[t] = self.tokenizer.decode([t])
                lp.decoded_token = text
        return lps

    def add_token(self, req: Request, logprobs: dict[int, Logprob] | None, now: float) -> bool:
        """Metrics, logprobs, text and stop conditions of the token just appended to ``req``;
        True when it finishes the request (its finish_reason is set; the caller frees it)."""
        token = req.output_token_ids[-1]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        if logprobs is not None:
            if req.cumulative_logprob is not None:
                req.cumulative_logprob += logprobs[token].logprob
            if req.logprobs is not None:
                req.logprobs.append(self.with_text(logprobs, req.params.detokenize))
        p = req.params
        assert p.stop_token_ids is not None  # validated params: a list
        detok = _detokenizer(req)
        reason: str | None
        stop: int | str | None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            # Like vLLM: EOS has no stop_reason, and a stop token adds text only with include_stop_str_in_output.
            reason, stop = "stop", (token if token in p.stop_token_ids else None)
            if p.include_stop_str_in_output:
                detok.add(token)
        else:
            stop = detok.add(token)
            reason = "stop" if stop is not None else None
            if reason is None and req.num_tokens >= req.max_total_tokens:
                reason = "length"
        if reason is None and req.grammar is not None and req.grammar.terminated:
            reason = "stop"  # the structure is complete and its end accepted (ignore_eos cannot go on)
        if reason is None:
            return False
        if not isinstance(stop, str):
            detok.flush()
        req.finish_reason, req.stop_reason = reason, stop
        req.metrics.finished_time = now
        return True

    def add_prompt_logprobs(self, chunks: Sequence[PromptChunk]) -> None:
        """Append each chunk's prompt logprobs (with their text) that its group lacks."""
        for chunk in chunks:
            assert chunk.group.prompt_logprobs is not None  # the chunk's group wants prompt logprobs
            detokenize = chunk.group.params.detokenize
            chunk.group.prompt_logprobs += [self.with_text(e, detokenize) for e in new_entries(chunk)]

    @staticmethod
    def make_outputs(groups: Sequence[RequestGroup]) -> list[RequestOutput]:
        """The RequestOutputs of the groups a step advanced; a best_of request (best_of > n)
        only once finished: until then its ranking means nothing."""
        return [make_output(g) for g in groups if g.finished or g.params.num_samples == g.params.n]


def make_output(group: RequestGroup) -> RequestOutput:
    """The group's RequestOutput now: its samples (best_of: the n best), text, logprobs."""
    samples = group.samples
    if group.params.num_samples > group.params.n:
        # best_of: the n samples with the highest cumulative logprob, best first.
        # Each sample tracks its cumulative logprob (Request.__post_init__, num_samples > n).
        samples = sorted(samples, key=lambda r: -cast(float, r.cumulative_logprob))[: group.params.n]
    completions = [
        CompletionOutput(
            index=i,
            text=_detokenizer(req).visible_text(req.finished),
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )
        for i, req in enumerate(samples)
    ]
    first = group.samples[0]
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        outputs=completions,
        finished=group.finished,
        metrics=first.metrics,
        num_cached_tokens=first.num_cached_tokens or 0,
        prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
    )


def _detokenizer(req: Request) -> IncrementalDetokenizer:
    assert req.detokenizer is not None  # add_request gives each request one
    return req.detokenizer
