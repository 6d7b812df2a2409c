"""The seams a new model family or attention variant plugs into (issue 53): the worker
knows no model family, only the ``CausalLM.fast_decode`` hook, and a family without it
is said to lack it once; whether attention runs in ctxpar's kernels or PyTorch is the
attention backend's choice alone."""

from __future__ import annotations

import logging

import pytest

from ctxpar.errors import CtxparError
from ctxpar.layers.attention.backend import AttentionSpec
from ctxpar.worker import model_runner
from tests.architecture.test_layering import ROOT, import_graph


def test_the_worker_imports_no_model_family() -> None:
    """ctxpar/worker/ reaches a model through the CausalLM protocol (models/base.py), never
    through a family's file (those the registry imports)."""
    graph = import_graph()
    families = {d for d in graph["ctxpar.models.registry"] if d.startswith("ctxpar.models.")}
    assert "ctxpar.models.llama" in families  # the registry's imports are read
    family = [f"{m} imports {d}" for m, deps in graph.items() if m.startswith("ctxpar.worker") for d in deps & families]
    assert family == []


def test_only_the_backend_and_the_compiled_loop_call_attention_kernels() -> None:
    """The attention kernels' wrappers are called from the attention backend (and the
    compiled decode loop, which reads a cache's format for its own kernel call); a layer
    that imported them would be choosing kernels-vs-PyTorch itself again."""
    wrapper = "ctxpar.kernels.attention_kernels"
    product = {m: deps for m, deps in import_graph().items() if not m.startswith("ctxpar.bench")}
    callers = sorted(m for m, deps in product.items() if wrapper in deps and not m.startswith("ctxpar.kernels"))
    allowed = {
        "ctxpar.layers.attention.backend",
        "ctxpar.models.compiled_decode",
        "ctxpar.costmodel.hardware_calibration",  # times the decode kernel itself
    }
    assert set(callers) <= allowed, callers
    assert (ROOT / "layers" / "attention" / "backend.py").is_file()


class _NoFastDecode:
    """A model without the hook (any family that has not written one)."""


def test_a_model_without_the_hook_is_said_to_lack_it_once(caplog: pytest.LogCaptureFixture) -> None:
    model_runner._SAID_LACKING.discard(_NoFastDecode.__name__)
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        assert model_runner.fast_decode_of(_NoFastDecode()) is None  # type: ignore[arg-type]
        assert model_runner.fast_decode_of(_NoFastDecode()) is None  # type: ignore[arg-type]
    said = [r.getMessage() for r in caplog.records if "_NoFastDecode" in r.getMessage()]
    assert len(said) == 1 and "no fast decode step" in said[0], said


@pytest.mark.parametrize("variant", [{"window": 0}, {"soft_cap": 0.0}, {"soft_cap": float("inf")}])
def test_attention_variants_out_of_range_are_refused(variant: dict) -> None:
    """A window or a soft-cap is a field of the layer's AttentionSpec (every backend computes
    both: tests/layers/test_attention_variants.py); one that means nothing is refused, naming it."""
    with pytest.raises(CtxparError, match="window must be a whole number|soft cap must be a positive"):
        AttentionSpec(0.125, **variant)
