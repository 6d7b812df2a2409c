"""Each EngineConfig knob's Range and choices (ctxpar/knobs.py) are what EngineConfig
enforces: a value just outside the range, or outside the choices, is refused with a
message naming the knob; the range's own edges are accepted."""

from __future__ import annotations

import pytest

from ctxpar import CtxparError
from ctxpar.config import EngineConfig
from ctxpar.knobs import FLAG, Range, knobs

RANGED = [(f.name, f.metadata[FLAG].range) for f in knobs(EngineConfig) if f.metadata[FLAG].range is not None]
CHOICES = [(f.name, f.metadata[FLAG].choices) for f in knobs(EngineConfig) if f.metadata[FLAG].choices]
# Fields whose floor alone does not make a valid config (dcp_size must also equal pcp_size or 1).
NEEDS = {"dcp_size": {"pcp_size": 1}}


@pytest.mark.filterwarnings("ignore:dcp_gather_ratio:FutureWarning")  # a deprecated knob, still checked
@pytest.mark.parametrize("name, r", RANGED, ids=[n for n, _ in RANGED])
def test_below_the_floor_is_refused_and_the_floor_accepted(name: str, r: Range) -> None:
    assert r.lo is not None
    lo = r.lo
    below = lo if r.lo_open else lo - 1
    while below in r.also:  # max_logprobs' -1 is allowed
        below -= 1
    with pytest.raises(CtxparError) as e:
        EngineConfig(**{name: below})
    assert e.value.args[0].startswith(f"{name} must be") and repr(below) in str(e.value)
    if not r.lo_open:
        EngineConfig(**{name: lo, **NEEDS.get(name, {})})


@pytest.mark.parametrize("name, r", RANGED, ids=[n for n, _ in RANGED])
def test_a_string_is_refused(name: str, r: Range) -> None:
    with pytest.raises(CtxparError, match=f"^{name} must be"):
        EngineConfig(**{name: "1"})


@pytest.mark.parametrize("name, choices", CHOICES, ids=[n for n, _ in CHOICES])
def test_outside_the_choices_is_refused(name: str, choices: tuple[str, ...]) -> None:
    with pytest.raises(CtxparError) as e:
        EngineConfig(**{name: "no-such-value"})
    assert name in str(e.value) and "'no-such-value'" in str(e.value)
