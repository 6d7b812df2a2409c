"""SamplingParams and EngineConfig refuse every bad value with a CtxparError
naming the field, the value and the allowed range; valid values pass through
unchanged. No model is loaded here."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar import CtxparError, SamplingParams
from ctxpar.checks import max_threads
from ctxpar.config import EngineConfig
from ctxpar.sampling_params import SEED_MAX, SEED_MIN

FLOAT_FIELDS = ("temperature", "top_p", "min_p")

valid_params = st.fixed_dictionaries(
    {
        "max_tokens": st.integers(1, 1 << 40),
        "temperature": st.one_of(st.just(0.0), st.floats(1e-6, 1e6)),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.one_of(st.just(-1), st.integers(1, 1 << 20)),
        "min_p": st.floats(0, 1),
        "seed": st.one_of(st.none(), st.integers(SEED_MIN, SEED_MAX)),
        "stop": st.one_of(st.none(), st.text(min_size=1), st.lists(st.text(min_size=1), max_size=3)),
        "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 1 << 20), max_size=3)),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.none(), st.integers(0, 100)),
        "skip_special_tokens": st.booleans(),
    }
)


@settings(max_examples=200, deadline=None)
@given(valid_params)
def test_any_valid_sampling_params_round_trip(kwargs):
    sp = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name != "stop_token_ids":
            assert getattr(sp, name) == value
    stops = kwargs["stop"]
    assert sp.stop_strings == ([] if stops is None else [stops] if isinstance(stops, str) else stops)
    assert sp.stop_token_ids == (kwargs["stop_token_ids"] or [])
    # Validating again (what the engine does when the request is added) and
    # copying (the engine's private snapshot) change nothing.
    sp.validate()
    assert dataclasses.replace(sp) == sp
    if sp.seed is not None:  # every accepted seed is one torch takes
        torch.Generator().manual_seed(sp.seed)


@settings(max_examples=100, deadline=None)
@given(valid_params, st.sampled_from(FLOAT_FIELDS), st.sampled_from([math.nan, -math.nan, math.inf, -math.inf]))
def test_any_non_finite_float_is_refused(kwargs, name, value):
    with pytest.raises(CtxparError) as e:
        SamplingParams(**{**kwargs, name: value})
    assert f"{name} must be a finite number" in str(e.value)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(FLOAT_FIELDS), st.sampled_from([math.nan, math.inf, -math.inf]))
def test_non_finite_float_set_after_construction_is_refused_on_validate(name, value):
    sp = SamplingParams()
    setattr(sp, name, value)
    with pytest.raises(CtxparError, match=name):
        sp.validate()


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, SEED_MAX])
def test_seed_limits_are_torchs(seed):
    SamplingParams(seed=seed)
    torch.Generator().manual_seed(seed)
    for outside in (SEED_MIN - 1, SEED_MAX + 1):
        with pytest.raises((ValueError, RuntimeError)):
            torch.Generator().manual_seed(outside)  # the limit is torch's own, not an invention


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(seed="x"), ["seed", "'x'"]),
        (dict(seed=True), ["seed", "True"]),
        (dict(seed=1.5), ["seed", "1.5"]),
        (dict(seed=-1), ["seed", "[0,", "-1"]),
        (dict(seed=1 << 64), ["seed", str((1 << 64) - 1)]),
        (dict(max_model_len=1), ["max_model_len", ">= 2", "1"]),
        (dict(max_model_len=0), ["max_model_len", "0"]),
        (dict(max_model_len=100.0), ["max_model_len", "100.0"]),
        (dict(block_size=0), ["block_size", "[1, 65536]", "0"]),
        (dict(block_size=1 << 20), ["block_size", "65536", str(1 << 20)]),
        (dict(block_size=True), ["block_size", "True"]),
        (dict(num_kv_blocks=0), ["num_kv_blocks", "0"]),
        (dict(num_kv_blocks=-5), ["num_kv_blocks", "-5"]),
        (dict(num_kv_blocks=2.0), ["num_kv_blocks", "2.0"]),
        (dict(kv_cache_bytes=0), ["kv_cache_bytes", "0"]),
        (dict(max_num_seqs=0), ["max_num_seqs", "0"]),
        (dict(max_num_batched_tokens=-1), ["max_num_batched_tokens", "-1"]),
        (dict(pcp_size=0), ["pcp_size", "0"]),
        (dict(pcp_size=True), ["pcp_size", "True"]),
        (dict(pcp_size="2"), ["pcp_size", "'2'"]),
        (dict(pcp_min_tokens=-1), ["pcp_min_tokens", ">= 0", "-1"]),
        (dict(pcp_min_tokens=False), ["pcp_min_tokens", "False"]),
        (dict(pcp_spread_min_rows=-1), ["pcp_spread_min_rows", ">= 0", "-1"]),
        (dict(pcp_split_mode="half"), ["pcp_split_mode", "'auto', 'all', 'disjoint', 'whole'", "'half'"]),
        (dict(hardware_profile=""), ["hardware_profile", "''"]),
        (dict(dcp_gather_ratio=-0.5), ["dcp_gather_ratio", ">= 0.0", "-0.5"]),
        (dict(dcp_gather_ratio=float("nan")), ["dcp_gather_ratio", "finite", "nan"]),
        (dict(dcp_gather_ratio="1"), ["dcp_gather_ratio", "'1'"]),
        (dict(num_threads=0), ["num_threads", "0"]),
        (dict(num_threads=max_threads() + 1), ["num_threads", f"[1, {max_threads()}]", str(max_threads() + 1)]),
        (dict(num_threads=10**9), ["num_threads", str(10**9)]),
        (dict(dtype="float64"), ["dtype", "float32", "'float64'"]),
        (dict(dtype=torch.float64), ["dtype", "torch.float64"]),
        (dict(dtype="fp8"), ["dtype", "'half'", "'fp8'"]),
        (dict(device="tpu"), ["device", "'tpu'"]),
        (dict(master_port=0), ["master_port", "[1, 65535]", "0"]),
        (dict(master_port=65536), ["master_port", "65536"]),
        (dict(master_port="29500"), ["master_port", "'29500'"]),
        (dict(master_port=True), ["master_port", "True"]),
        (dict(master_addr=""), ["master_addr", "''"]),
        (dict(master_addr=None), ["master_addr", "None"]),
        (dict(model=42), ["model", "42"]),
        (dict(quantization="awq"), ["quantization='awq'", "'gguf'", "'none'"]),
        (dict(quantization=4), ["quantization=4"]),
        (dict(quantization="gguf", model="/"), ["quantization='gguf'", "directory", ".gguf"]),
        (dict(quantization="gguf", device="cuda"), ["quantization='gguf'", "device='cpu'"]),
    ],
)
def test_bad_engine_config(kwargs, words):
    with pytest.raises(CtxparError) as e:
        EngineConfig(**kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_engine_config_edges_accepted():
    EngineConfig(
        max_model_len=2,
        block_size=1 << 16,
        seed=(1 << 64) - 1,
        num_threads=max_threads(),
        pcp_min_tokens=0,
        master_port=65535,
        num_kv_blocks=1,
    )


def test_dcp_gather_ratio_is_deprecated_but_accepted():
    """The retired knob still starts an engine (as vLLM keeps a deprecated argument for a
    while), with a warning that says it does nothing, from the API and from the CLI."""
    import argparse

    from ctxpar.engine.arg_utils import EngineArgs

    with pytest.warns(FutureWarning, match="dcp_gather_ratio .* deprecated and has no effect"):
        assert EngineConfig(pcp_size=2, dcp_size=2, dcp_gather_ratio=0.5).dcp_gather_ratio == 0.5
    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--dcp-gather-ratio", "1"])
    with pytest.warns(FutureWarning, match="--dcp-gather-ratio"):
        EngineArgs.from_cli_args(args).create_engine_config()


def test_quantization_spellings_and_detection(tmp_path):
    """None detects, as vLLM does: a .gguf file (the default model is one) on the CPU keeps
    its blocks; a directory, or a GPU, computes in the dtype; "none" always dequantizes."""
    assert EngineConfig().quantization is None and EngineConfig().weight_quantization == "gguf"
    assert EngineConfig(model=str(tmp_path / "m.gguf"), device="cpu").weight_quantization == "gguf"
    assert EngineConfig(model=tmp_path / "M.GGUF", device="cpu").weight_quantization == "gguf"  # a Path, any case
    assert EngineConfig(model=str(tmp_path)).weight_quantization is None
    assert EngineConfig(device="cuda").weight_quantization is None
    assert EngineConfig(quantization="none").weight_quantization is None
    assert EngineConfig(quantization="gguf").weight_quantization == "gguf"
    assert EngineConfig(model=str(tmp_path), quantization="int8").weight_quantization == "int8"


def test_num_kv_blocks_beyond_the_machine_is_refused_before_any_model_loads():
    from ctxpar.checks import machine_memory_bytes
    from ctxpar.config import BLOCK_ID_BYTES

    most = machine_memory_bytes() // BLOCK_ID_BYTES
    EngineConfig(num_kv_blocks=most)  # the config alone allocates nothing
    with pytest.raises(CtxparError) as e:
        EngineConfig(num_kv_blocks=most + 1)
    assert f"num_kv_blocks={most + 1}" in str(e.value) and f"at most {most} blocks" in str(e.value)


@pytest.mark.parametrize(
    "spelling, canonical",
    [
        ("float32", "float32"),
        ("float", "float32"),
        (torch.float32, "float32"),
        ("half", "float16"),
        ("float16", "float16"),
        (torch.float16, "float16"),
        ("bfloat16", "bfloat16"),
        (torch.bfloat16, "bfloat16"),
    ],
)
def test_dtype_spellings(spelling, canonical):
    assert EngineConfig(dtype=spelling).dtype == canonical


def test_auto_dtype_is_bf16_only_with_native_bf16():
    from ctxpar.device import cpu_has_native_bf16

    want = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert EngineConfig(dtype="auto", device="cpu").dtype == want


def test_a_rank_binds_its_gpu(monkeypatch):
    """Each rank makes its GPU the current device before anything else (NCCL, handles);
    on the CPU nothing is bound. (CI has no GPU: torch.cuda.set_device is recorded.)"""
    import torch

    from ctxpar.device import bind_device

    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    bind_device(torch.device("cpu"))
    bind_device(torch.device("cuda", 1))
    assert bound == [torch.device("cuda", 1)]
