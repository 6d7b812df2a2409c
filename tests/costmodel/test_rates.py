"""A profile's measured rates are a typed record keyed by kind, dtype and width
(ctxpar/costmodel/rates.py): a profile saved before it, with its rates as notes, loads
with the same rates and is priced the same; a rate that names no kind or dtype is
refused when it loads, not silently missed when looked up."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ctxpar.costmodel import estimate, load_hardware, load_model_shape
from ctxpar.costmodel.rates import Rate, Rates
from ctxpar.errors import CtxparError
from helpers.rates import rates

MEASURED = {
    ("gemm_flops", "fp32"): 150e9,
    ("gemm_flops", "q4"): 600e9,
    ("weight_read_bandwidth", "q4"): 18e9,
    ("weight_read_bandwidth", "fp32"): 15e9,
    ("gemm_flops", "q4", 2048): 620e9,
    ("gemm_flops", "q4", 4096): 540e9,
    ("weight_read_bandwidth", "q4", 2048): 19e9,
    ("weight_read_bandwidth", "q4", 4096): 23e9,
    ("attention_flops", "fp32"): 40e9,
    ("attention_flops", "bf16"): 120e9,
    ("kv_read_bandwidth", "bf16"): 14e9,
    ("elementwise_bandwidth", "bf16", 2048): 8e9,
    ("elementwise_bandwidth", "bf16", 4096): 6e9,
    ("step_overhead_s", "bf16"): 6.5e-4,
    ("layer_overhead_s", "bf16"): 1.7e-4,
}


def _note(key: tuple) -> str:
    """The key a profile saved before Rates gave the rate ``key`` in its notes."""
    return "_".join(key[:2]) + (f"_hidden{key[2]}" if len(key) == 3 else "")


def test_a_profile_saved_with_rates_as_notes_loads_with_them(tmp_path: Path) -> None:
    rank = dataclasses.replace(load_hardware("cpu-core-shm"), lead=None, weight_dtype="fp32", rates=rates(MEASURED))
    typed = dataclasses.replace(rank, lead=dataclasses.replace(rank, name="lead", gemm_flops=2 * rank.gemm_flops))
    old = json.loads(typed.to_json())
    record = {"threads": 1, "shm_latency_s": 6e-5}
    for profile in (old, old["lead"]):
        del profile["rates"]
        profile["notes"] = {_note(key): value for key, value in MEASURED.items()} | record
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = load_hardware(str(path))
    assert loaded == dataclasses.replace(typed, notes=record, lead=dataclasses.replace(typed.lead, notes=record))
    for priced in (lambda h: h, lambda h: h.with_weight_dtype("q4").with_activation_dtype("bf16")):
        for model in ("llama-3.2-1b", "llama-3-8b"):
            m = load_model_shape(model)
            assert estimate(m, priced(loaded), 4096, pcp=[1, 2]) == estimate(m, priced(typed), 4096, pcp=[1, 2])
    again = tmp_path / "again.json"
    again.write_text(loaded.to_json())
    assert load_hardware(str(again)) == loaded


def test_the_rates_taken_are_the_measured_ones() -> None:
    profile = dataclasses.replace(load_hardware("cpu-core-shm"), lead=None, weight_dtype="fp32", rates=rates(MEASURED))
    q4 = profile.with_weight_dtype("q4").with_activation_dtype("bf16")
    assert (q4.gemm_flops, q4.weight_read_bandwidth, q4.attention_flops) == (600e9, 18e9, 120e9)
    assert (q4.kv_read_bandwidth, q4.step_overhead_s, q4.layer_overhead_s) == (14e9, 6.5e-4, 1.7e-4)
    at_8b = q4.for_model(load_model_shape("llama-3-8b"))
    assert (at_8b.gemm_flops, at_8b.weight_read_bandwidth, at_8b.elementwise_bandwidth) == (540e9, 23e9, 6e9)


@pytest.mark.parametrize(
    "rate, words",
    [
        ({"kind": "gemm_flop", "dtype": "q4", "value": 1e9}, ["gemm_flop", "gemm_flops"]),
        ({"kind": "gemm_flops", "dtype": "q5", "value": 1e9}, ["'q5'", "q4"]),
        ({"kind": "gemm_flops", "dtype": "q4", "value": -1.0}, ["value", ">= 0"]),
        ({"kind": "gemm_flops", "dtype": "q4", "value": 1e9, "hidden": 0}, ["hidden", ">= 1"]),
        ({"kind": "gemm_flops", "dtype": "q4", "rate": 1e9}, ["rate"]),
    ],
)
def test_a_stored_rate_that_names_nothing_is_refused(tmp_path: Path, rate: dict, words: list[str]) -> None:
    profile = json.loads(load_hardware("cpu-core-gloo").to_json()) | {"rates": {"measured": [rate]}}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(CtxparError) as e:
        load_hardware(str(path))
    assert str(e.value).startswith(f"hardware profile {path}: ")
    for w in words:
        assert w in str(e.value)


def test_a_rate_measured_twice_is_refused() -> None:
    with pytest.raises(CtxparError, match="measured twice"):
        Rates.of([Rate("gemm_flops", "q4", 1e9, 2048), Rate("gemm_flops", "q4", 2e9, 2048)])
