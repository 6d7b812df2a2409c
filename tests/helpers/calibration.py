"""`ctxpar calibrate`'s rank measurements at small sizes: for tests whose subject is
not the rank's figures (which tests/costmodel/test_hardware_calibration.py checks),
so that they time a few small GEMMs, reads and layers instead of seconds of large ones."""

from __future__ import annotations

import pytest

from ctxpar.costmodel import hardware_calibration as cal

SMALL_LAYERS = ((64, [(256, 64)]), (128, [(128, 128), (64, 256)]))  # WEIGHT_LAYERS' form, small
# ELEMENTWISE_LAYERS' form, small: Llama configs of two widths.
SMALL_CONFIG = {"intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64}
SMALL_ELEMENTWISE_LAYERS = (
    (64, SMALL_CONFIG | {"hidden_size": 64, "num_key_value_heads": 2}),
    (128, SMALL_CONFIG | {"hidden_size": 128, "num_key_value_heads": 2, "head_dim": 64}),
)


def small_rank_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every size the rank's calibration times, and its time budget per figure, made small."""
    monkeypatch.setattr(cal, "BUDGET_S", 0.02)
    monkeypatch.setattr(cal, "GEMM_SHAPES", [(64, 64, 64)])
    monkeypatch.setattr(cal, "ATTN_SHAPE", (64, 4, 16))
    monkeypatch.setattr(cal, "KV_SHAPE", (256, 8, 2, 64))
    monkeypatch.setattr(cal, "READ_BYTES", 1 << 20)
    monkeypatch.setattr(cal, "WEIGHT_LAYERS", SMALL_LAYERS)
    monkeypatch.setattr(cal, "ELEMENTWISE_LAYERS", SMALL_ELEMENTWISE_LAYERS)
    monkeypatch.setattr(cal, "ELEMENTWISE_TOKENS", 32)
