"""Stop strings matched by one automaton (Aho-Corasick), however many a request gives.

A request's stop strings become one trie with failure links, built once when the
request is checked (off the engine thread: ``InputProcessor.process_tokens``) and
shared by its samples; each sample's detokenizer keeps only its place in it. Each
new character then costs one transition on average, whatever the number of stop
strings, where a ``str.find`` per stop string per token made one request able to
stall every step (issue 52).

The match reported is the one ``str.find`` per stop string would report: of the
stop strings that end in the new text, the one that starts first; on a tie, the
first in the request's list.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    """A stop string found: where it starts in the text, and which one it is."""

    start: int
    stop: str


class StopStrings:
    """The automaton of a request's stop strings (read-only once built: samples share it)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self._goto: list[dict[str, int]] = [{}]  # state -> char -> state; state 0 is the root
        # state -> (length, list index) of the longest stop string that ends at it (its
        # suffixes included): at one end position the longest starts first. (0, -1): none.
        self._out: list[tuple[int, int]] = [(0, -1)]
        for index, s in enumerate(stops):
            state = 0
            for c in s:
                nxt = self._goto[state].get(c)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[state][c] = nxt
                    self._goto.append({})
                    self._out.append((0, -1))
                state = nxt
            if self._out[state][1] < 0:  # a repeated stop string keeps its first place
                self._out[state] = (len(s), index)
        self._fail = [0] * len(self._goto)
        self._link()

    def _link(self) -> None:
        """Failure links, breadth first: a state's longest proper suffix that is a trie state."""
        queue = deque(self._goto[0].values())
        while queue:
            state = queue.popleft()
            for c, nxt in self._goto[state].items():
                queue.append(nxt)
                f = self._fail[state]
                while f and c not in self._goto[f]:
                    f = self._fail[f]
                self._fail[nxt] = self._goto[f].get(c, 0)
                if self._out[nxt][1] < 0:
                    self._out[nxt] = self._out[self._fail[nxt]]

    def step(self, state: int, c: str) -> int:
        """The state after reading ``c`` in ``state``."""
        while state and c not in self._goto[state]:
            state = self._fail[state]
        return self._goto[state].get(c, 0)

    def scan(self, state: int, text: str, offset: int) -> tuple[int, StopMatch | None]:
        """Read ``text`` (which starts at ``offset`` in the whole text) from ``state``: the
        state after it, and the stop string that ends in it and starts first, if any."""
        best: tuple[int, int] | None = None  # (start, list index)
        for i, c in enumerate(text):
            state = self.step(state, c)
            length, index = self._out[state]
            if index >= 0:
                found = (offset + i - length + 1, index)
                if best is None or found < best:
                    best = found
        return state, (StopMatch(best[0], self.stops[best[1]]) if best is not None else None)
