"""What each output of a request carries, by its ``SamplingParams.output_kind``
(vLLM's RequestOutputKind): everything so far (CUMULATIVE, the engine's own
outputs), only what is new since the request's previous output (DELTA: text,
token ids and logprobs; prompt logprobs in the first one only), or nothing
until it finishes (FINAL_ONLY)."""

from __future__ import annotations

import dataclasses

from ctxpar.outputs import RequestOutput
from ctxpar.sampling_params import RequestOutputKind


@dataclasses.dataclass
class _Sent:
    """How much of each sample a DELTA request has already been given."""

    tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # sample index -> token ids sent
    chars: dict[int, int] = dataclasses.field(default_factory=dict)  # sample index -> characters of text sent
    first: bool = True


class OutputShaper:
    """Turns the engine's cumulative outputs into each request's output kind."""

    def __init__(self) -> None:
        self._kinds: dict[str, RequestOutputKind] = {}
        self._sent: dict[str, _Sent] = {}

    def add(self, request_id: str, kind: RequestOutputKind) -> None:
        self._kinds[request_id] = kind
        if kind is RequestOutputKind.DELTA:
            self._sent[request_id] = _Sent()

    def forget(self, request_id: str) -> None:
        self._kinds.pop(request_id, None)
        self._sent.pop(request_id, None)

    def shape(self, out: RequestOutput) -> RequestOutput | None:
        """The output to hand out for ``out``, or None (FINAL_ONLY, not finished yet)."""
        kind = self._kinds.get(out.request_id, RequestOutputKind.CUMULATIVE)
        sent = self._sent.get(out.request_id)
        if out.finished:
            self.forget(out.request_id)
        if kind is RequestOutputKind.FINAL_ONLY:
            return out if out.finished else None
        if kind is RequestOutputKind.CUMULATIVE or sent is None:
            return out
        deltas = []
        for c in out.outputs:
            n, k = sent.tokens.get(c.index, 0), sent.chars.get(c.index, 0)
            sent.tokens[c.index], sent.chars[c.index] = len(c.token_ids), len(c.text)
            deltas.append(
                dataclasses.replace(
                    c,
                    text=c.text[k:],
                    token_ids=c.token_ids[n:],
                    logprobs=c.logprobs[n:] if c.logprobs is not None else None,
                )
            )
        first, sent.first = sent.first, False
        return dataclasses.replace(out, outputs=deltas, prompt_logprobs=out.prompt_logprobs if first else None)
