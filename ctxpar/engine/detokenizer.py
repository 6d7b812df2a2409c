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
in the output. Shown text therefore only ever grows. With
``include_stop_str_in_output`` the stop string stays in the text (cut just
after it) and nothing is held back, as in vLLM. Stop strings count only once
more than ``min_tokens`` tokens were generated. They are found by one automaton
over the new characters (stop_strings.py), whatever their number.
"""

from __future__ import annotations

from typing import Any

from ctxpar.engine.stop_strings import StopStrings

_PROMPT_CONTEXT = 6  # prompt tokens that seed the window
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output tokens into text, one token at a time."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: StopStrings,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """tokenizer: None when there is none or the request asked for detokenize=False."""
        self.tokenizer = tokenizer
        self.decode_kwargs = dict(
            skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # decoded output so far (cut at a stop string once one is seen)
        self.stop = stop
        self.stop_state = 0  # the text's place in the stop strings' automaton
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_tokens = 0  # generated tokens added
        self.hold_back = 0 if include_stop_str_in_output else max(stop.longest - 1, 0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode_kwargs)

    def add(self, token_id: int) -> str | None:
        """Append one generated token. Returns the stop string it completed, if any
        (the text is then cut before it, or after it with include_stop_str_in_output)."""
        if self.tokenizer is None:
            return None
        self.num_tokens += 1
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
        if not self.stop.stops:
            return None
        # Every character goes through the automaton, so that a stop string begun before
        # min_tokens and ended after is found; only a match that ends in the new text is new.
        self.stop_state, match = self.stop.scan(self.stop_state, delta, start)
        if match is None or self.num_tokens <= self.min_tokens:
            return None
        self.text = self.text[: match.start + (len(match.stop) if self.include_stop else 0)]
        return match.stop

    def visible_text(self, finished: bool) -> str:
        """Text that is final: all of it once finished, else minus the hold-back."""
        if finished or self.hold_back == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]
