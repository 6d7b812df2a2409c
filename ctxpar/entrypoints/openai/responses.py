"""Engine outputs -> OpenAI response bodies (whole, or as streamed deltas).

Engine outputs are cumulative (all the text and tokens so far), so a stream
keeps, per choice, how much it has sent and emits the rest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ctxpar.outputs import Logprob, RequestOutput


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(rid: str, obj: str, model: str, created: int, choices: list[dict], **extra: Any) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}


def now() -> int:
    return int(time.time())


@dataclass
class Delta:
    """What one choice's next output adds to what was already sent."""

    text: str
    token_ids: list[int]
    logprobs: Sequence[dict[int, Logprob] | None] | None  # None in the list: an echoed prompt's first token
    text_offset: int  # characters sent before this delta (completions' text_offset)


class ChoiceCursor:
    """How much of one choice (sample ``sample`` of a request) has been sent; ``advance`` returns the rest."""

    def __init__(self, sample: int = 0) -> None:
        self.sample = sample
        self.chars = 0
        self.tokens = 0
        self.finished = False  # its finish_reason was sent

    def peek(self, out: RequestOutput) -> Delta:
        """The unsent rest, still unsent (a stream may wait for text before sending tokens)."""
        c = out.outputs[self.sample]
        return Delta(
            c.text[self.chars :],
            c.token_ids[self.tokens :],
            c.logprobs[self.tokens :] if c.logprobs is not None else None,
            self.chars,
        )

    def has_news(self, out: RequestOutput) -> bool:
        """Text to send, or an end not yet announced (tokens alone wait for their text)."""
        return bool(self.peek(out).text) or (out.outputs[self.sample].finished() and not self.finished)

    def due(self, out: RequestOutput, interval: int) -> bool:
        """Whether a stream sends now: the first chunk and the end at once, others every ``interval`` tokens."""
        c = out.outputs[self.sample]
        return self.chars == 0 or c.finished() or len(c.token_ids) - self.tokens >= interval

    def advance(self, out: RequestOutput) -> Delta:
        """The unsent rest, now counted as sent."""
        d = self.peek(out)
        c = out.outputs[self.sample]
        self.chars, self.tokens, self.finished = len(c.text), len(c.token_ids), c.finished()
        return d


# JSON has no -inf: a token the constraint ruled out is reported at this logprob instead (as vLLM and OpenAI).
MIN_LOGPROB = -9999.0


def _token_text(tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    if as_id:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id]) if tokenizer is not None else ""


def _logprob(lp: Logprob) -> float:
    return max(lp.logprob, MIN_LOGPROB)


def echoed(out: RequestOutput, tokenizer, d: Delta) -> Delta:
    """``d`` with the prompt before it (completions' echo): its text, its tokens and, where the
    engine computed them, its logprobs (the first token's None: it has no context)."""
    prompt = out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)
    lps = None
    if d.logprobs is not None and out.prompt_logprobs is not None:
        lps = [*out.prompt_logprobs, *d.logprobs]
    return Delta(prompt + d.text, [*out.prompt_token_ids, *d.token_ids], lps, 0)


def completion_logprobs(tokenizer, d: Delta, as_ids: bool = False) -> dict | None:
    """/v1/completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset.

    top_logprobs holds the requested most likely tokens plus the sampled one, as vLLM's does;
    a position without logprobs (an echoed prompt's first token) has null in both."""
    if d.logprobs is None:
        return None
    tokens = [_token_text(tokenizer, t, as_ids) for t in d.token_ids]
    offsets, pos = [], d.text_offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else _logprob(lp[t]) for t, lp in zip(d.token_ids, d.logprobs)],
        "top_logprobs": [
            None if lp is None else {_token_text(tokenizer, k, as_ids): _logprob(v) for k, v in lp.items()}
            for lp in d.logprobs
        ],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, d: Delta, top: int, as_ids: bool = False) -> dict | None:
    """/v1/chat/completions' logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if d.logprobs is None:
        return None

    def entry(t: int, lp: Logprob) -> dict:
        s = _token_text(tokenizer, t, as_ids)
        return {"token": s, "logprob": _logprob(lp), "bytes": list(s.encode("utf-8"))}

    content = []
    for t, lp in zip(d.token_ids, d.logprobs):
        assert lp is not None  # generated tokens all have logprobs
        best = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:top]
        content.append({**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in best]})
    return {"content": content}


def prompt_logprobs(out: RequestOutput) -> list[dict[str, dict] | None] | None:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}}; the first is None."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if lp is None
        else {str(k): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token} for k, v in lp.items()}
        for lp in out.prompt_logprobs
    ]


def finish_fields(out: RequestOutput, sample: int = 0) -> dict:
    """finish_reason as OpenAI defines it ("stop", "length"; null while running) and vLLM's stop_reason."""
    c = out.outputs[sample]
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
