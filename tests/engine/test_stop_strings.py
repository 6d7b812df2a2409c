"""The stop strings' automaton (ctxpar/engine/stop_strings.py) against str.find per stop
string, the matching it replaced: the same stop string at the same place on random texts
fed in random pieces; and its cost per character does not grow with the number of stops."""

from __future__ import annotations

import random
import time

from ctxpar.engine.stop_strings import StopStrings


def find_each(text: str, start: int, stops: list[str]) -> tuple[int, str] | None:
    """The first stop string (earliest start, then list order) ending at or after ``start``."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def test_same_match_as_find_per_stop_string():
    rng = random.Random(0)
    for trial in range(400):
        alphabet = "ab" if trial % 2 else "abc "
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 8))]
        automaton = StopStrings(stops)
        text, state = "", 0
        while len(text) < 40:
            delta = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            start = len(text)
            text += delta
            state, match = automaton.scan(state, delta, start)
            expected = find_each(text, start, stops)
            assert (None if match is None else (match.start, match.stop)) == expected, (stops, text, start)
            if expected is not None:
                break


def test_cost_per_character_does_not_grow_with_the_stops():
    """1,000 stop strings of 16 characters cost about what one does per new character."""
    rng = random.Random(1)
    many = ["".join(rng.choice("abcdefgh") for _ in range(16)) for _ in range(1000)]
    text = "".join(rng.choice("abcdefgh ") for _ in range(20000))

    def seconds(stops: list[str]) -> float:
        automaton, state = StopStrings(stops), 0
        t0 = time.perf_counter()
        for i in range(0, len(text), 4):
            state, _ = automaton.scan(state, text[i : i + 4], i)
        return time.perf_counter() - t0

    one = min(seconds(many[:1]) for _ in range(3))
    assert min(seconds(many) for _ in range(3)) < 4 * one + 0.01
