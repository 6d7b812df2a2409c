"""Ranks sharing a host's cores lead a step that splits no prompt on rank 0 with their
threads together, capped at the cores the host gives the process: three one-thread
ranks on two cores lead with two threads, not three spinning against each other."""

from __future__ import annotations

import pytest

from ctxpar.worker import options


@pytest.mark.parametrize(
    "cores, threads, pcp, lead",
    [
        (2, 1, 2, 2),  # the ranks' threads together: every core
        (2, 1, 3, 2),  # three ranks on two cores: two threads
        (2, 4, 2, 4),  # never fewer than a rank's own threads
        (16, 1, 3, 3),
        (16, 2, 4, 8),
        (16, 4, 1, None),  # one rank: nothing to lead
    ],
)
def test_lead_threads_capped_at_the_cores(monkeypatch, cores: int, threads: int, pcp: int, lead: int | None) -> None:
    monkeypatch.setattr(options, "usable_cores", lambda: cores)
    assert options._lead_threads(threads, pcp) == lead
