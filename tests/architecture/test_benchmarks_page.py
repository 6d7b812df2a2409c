"""docs/benchmarks.md is a results page: each benchmark's latest figures with the command
and the machine, short enough to read (at most 700 lines), and no commit hashes (the
history of a figure is `git log -p docs/benchmarks.md`, not prose). When this fails:
replace a section's figures by the new run's rather than adding beside them."""

from __future__ import annotations

import re
from pathlib import Path

import ctxpar

PAGE = Path(ctxpar.__file__).parent.parent / "docs" / "benchmarks.md"
MOST_LINES = 700
# A commit's abbreviated or full hash: 7-40 hex digits with a letter and a digit among them.
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def test_the_page_is_short() -> None:
    lines = len(PAGE.read_text().splitlines())
    assert lines <= MOST_LINES, f"docs/benchmarks.md has {lines} lines, at most {MOST_LINES}: condense it"


def test_the_page_names_no_commit() -> None:
    hashes = sorted(set(HASH.findall(PAGE.read_text())))
    assert not hashes, f"docs/benchmarks.md names commits {hashes}: say what was measured, not when"
