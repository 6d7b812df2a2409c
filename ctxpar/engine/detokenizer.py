"""Incremental detokenization and stop strings, for streaming.

Decoding one token at a time is wrong for byte-level BPE (a character split
over tokens decodes to U+FFFD until its last byte arrives) and for
SentencePiece (a word's leading space depends on the token before it). So,
like vLLM, we decode a short window ``ids[prefix_offset:]`` and emit only what
it adds to ``ids[prefix_offset:read_offset]``, and only once it does not end
in an incomplete character. The window starts with the prompt's last tokens,
so the first generated word gets its leading space right.

The text shown while streaming holds back the last ``len(longest stop) - 1``
characters: they could be the start of a stop string, which must not appear
in the output. Shown text therefore only ever grows.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 6  # prompt tokens that seed the window
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output tokens into text, one token at a time."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # decoded output so far (cut before a stop string once one is seen)
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Append one generated token. Returns the stop string it completed, if any
        (the text is then cut before it)."""
        if self.tokenizer is None:
            return None
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return None  # nothing printable yet
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._append(delta)

    def flush(self) -> None:
        """At the end, emit any bytes still waiting for the rest of a character."""
        if self.tokenizer is None or self.read_offset == len(self.ids):
            return
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.read_offset = len(self.ids)
        if len(full) > len(prefix):
            self._append(full[len(prefix) :])

    def _append(self, delta: str) -> str | None:
        start = len(self.text)
        self.text += delta
        best: tuple[int, str] | None = None
        for s in self.stop:
            # Only a match that touches the new text can be new.
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def visible_text(self, finished: bool) -> str:
        """Text that is final: all of it once finished, else minus the hold-back."""
        if finished or self.hold_back == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]
