"""The cost model's prediction of each published step (costmodel/published.py), for
the table of predicted vs published in docs/scaling.md and its test."""

from __future__ import annotations

from ctxpar.costmodel.profiles import load_hardware
from ctxpar.costmodel.published import PublishedStep
from ctxpar.costmodel.shapes import load_model_shape
from ctxpar.costmodel.timing import decode_time, prefill_time


def predicted_s(step: PublishedStep) -> float:
    """Seconds the model predicts for ``step`` on one rank at batch 1: the prefill of its
    prompt (TTFT), or a decode step at its mean context (ITL)."""
    m, h = load_model_shape(step.model), load_hardware(step.hardware)
    if step.kind == "ttft":
        return prefill_time(m, h, step.prompt, 0, 1, 1, 1, "gather").total_s
    return decode_time(m, h, step.context, 1, 1).total_s


def error(step: PublishedStep) -> float:
    """predicted / published - 1."""
    return predicted_s(step) / step.seconds - 1
