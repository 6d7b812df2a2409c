"""The cost model's KV cache dtype: a quantized cache's bytes per token are the rows the
engine allocates (ctxpar.layers.kv_quant.KVQuant, on the real model classes), and they
shrink what the model predicts a cache costs: its memory, its reads, its transfers."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from ctxpar.costmodel import estimate, load_hardware, load_model_shape
from ctxpar.costmodel.shapes import shape_from_hf_config
from ctxpar.costmodel.timing import decode_time
from ctxpar.layers.kv_quant import KVQuant
from helpers.models import meta_model


@pytest.mark.parametrize("name", ["llama", "qwen3", "deepseek-v3"])
def test_kv_bytes_are_the_engine_cache_rows(name: str) -> None:
    config, model = meta_model(name)
    shape = shape_from_hf_config(config.to_dict(), name)
    assert shape.kv_bytes("auto", 4.0) == 4 * math.prod(model.kv_entry_shape)
    for kv in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        quant = KVQuant.of(kv, tuple(model.kv_entry_shape), tuple(model.kv_scale_runs))
        assert quant is not None and shape.kv_bytes(kv, 4.0) == quant.row_bytes


def test_a_quantized_cache_costs_less_memory_and_reads() -> None:
    model, h100 = load_model_shape("llama-3-70b"), load_hardware("h100x8-ib")
    fp8 = h100.with_kv_cache_dtype("fp8")
    bf16_row, fp8_row = h100.kv_token_bytes(model), fp8.kv_token_bytes(model)
    assert fp8_row < bf16_row / 1.9  # a byte a value against two, plus a scale per head

    def kv_of(h) -> float:
        (e,) = estimate(model, h, 131072, pcp=[1], dcp=[1])
        return e.kv_bytes

    assert kv_of(fp8) == pytest.approx(kv_of(h100) * fp8_row / bf16_row)
    # A decode step at 128K reads the whole cache: it reads fewer bytes of it.
    assert decode_time(model, fp8, 131072, 1, 1).memory_s < decode_time(model, h100, 131072, 1, 1).memory_s
    cpu = load_hardware("cpu-core-shm").with_kv_cache_dtype("int8")
    assert cpu.lead is not None and cpu.lead.kv_cache_dtype == "int8"  # a led step reads the same cache


def test_estimate_cli_takes_the_kv_cache_dtype() -> None:
    def run(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "ctxpar.cli", "estimate", "--model", "llama-3-8b", "--hardware", "h100x8-ib"]
        return subprocess.run([*cmd, "--context", "32768", "--pcp", "1", *extra], capture_output=True, text=True)

    auto, fp8 = run("--json"), run("--json", "--kv-cache-dtype", "fp8")
    assert auto.returncode == 0 and fp8.returncode == 0, auto.stderr + fp8.stderr
    import json

    gib = [json.loads(r.stdout)[0]["memory_gib_per_rank"] for r in (auto, fp8)]
    assert gib[1] < gib[0]
    bad = run("--kv-cache-dtype", "fp4")
    assert bad.returncode == 2 and "invalid choice: 'fp4'" in bad.stderr and "Traceback" not in bad.stderr


def test_a_profile_with_an_unknown_kv_cache_dtype_is_refused(tmp_path) -> None:
    import dataclasses
    import json

    from ctxpar.errors import CtxparError

    profile = {**dataclasses.asdict(load_hardware("cpu-core-gloo")), "kv_cache_dtype": "fp4"}
    path = tmp_path / "box.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(CtxparError, match="kv_cache_dtype must be one of auto, fp8"):
        load_hardware(str(path))
