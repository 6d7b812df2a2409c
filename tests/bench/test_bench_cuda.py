"""`ctxpar bench cuda` rehearsed on the CPU at small sizes: the same code a GPU
runs (ctxpar and transformers on one device, a random model's weights handed to
ctxpar's loader), so the first GPU run does not fail on the bench itself."""

from __future__ import annotations

import json

from ctxpar.cli import main


def test_bench_cuda_on_the_cpu(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CTXPAR_KERNELS", "0")  # the PyTorch path, as on a GPU
    out = tmp_path / "cuda.json"
    args = ["bench", "cuda", "--device", "cpu", "--models", "qwen3", "--prompt-lens", "20", "45", "--max-new", "3"]
    args += ["--layers", "2", "--lengths", "64", "--speed-model", "smollm2-135m", "--speed-layers", "1"]
    args += ["--decode-steps", "2", "--hardware", "cpu-core-shm", "--json", str(out)]
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert res["failures"] == {}
    exact = res["correctness"]["qwen3 float32 kv=auto"]
    assert exact["prompt_logprob_max_abs_diff"] < 1e-4
    assert exact["greedy_tokens_agreeing"] == "6/6"
    assert exact["prefix_hit_cached_tokens"] == 32  # the longest prompt's two whole blocks
    assert set(res["correctness"]) == {f"qwen3 float32 kv={kv}" for kv in ("auto", "int8", "fp8")} | {
        "qwen3 bfloat16 kv=auto"
    }
    row = res["speed"]["rows"]["64"]
    assert row["ctxpar_first"] == row["hf_first"]  # the same weights, through ctxpar's loader
    assert row["first_logprob_diff"] < 1e-2  # bf16
    assert row["predicted_ttft_s"] > 0 and row["ctxpar_decode_s"] > 0
