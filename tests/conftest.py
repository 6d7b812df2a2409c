"""Shared fixtures: tiny random models built and saved with transformers
(helpers/models.py), and the kernel builds to run.

Helper functions and classes live in the helpers package (tests/helpers/),
imported as ``from helpers.models import save_tiny_model``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.compiler_cache import keep, write_cached_compiler
from helpers.models import save_tiny_model, tiny_configs


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """{name: directory} of tiny random Llama-family checkpoints."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: save_tiny_model(cfg, root / name) for name, cfg in tiny_configs().items()}


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own GGUF loader on the default SmolLM2 file (an independent
    dequantise and un-permute): the reference model, loaded once for the session."""
    import torch
    from transformers import AutoModelForCausalLM

    from ctxpar.models.loader import default_model_path

    p = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def cached_cxx(tmp_path_factory) -> str:
    """A ``$CXX`` for the tests that make the kernel library build again in a fresh directory:
    g++, whose builds are kept and given again for the same command (helpers/compiler_cache.py),
    starting with the library this session has built for this CPU."""
    import os
    import subprocess

    from ctxpar.kernels import build

    cxx, store = os.environ.get("CXX", "g++"), tmp_path_factory.mktemp("cxx")
    lib, flags = build.library(), [*build.FLAGS, f"-march={build.target_cpu()}"]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    if lib is not None and Path(lib._name).name == build.library_name(flags, version):  # the sources' own
        keep(store, cxx, [*flags, *map(str, build.SOURCES), "-o", "library.so"], Path(lib._name))
    return str(write_cached_compiler(store, cxx))


@pytest.fixture(params=["native", "haswell"])
def march(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernels built for this CPU, and for an AVX2-only one (the code path of
    CPUs without AVX-512: 8-float vectors, smaller tiles), which this CPU runs too."""
    from ctxpar import kernels
    from ctxpar.machine import cpu_info

    if request.param != "native":
        if "avx2" not in cpu_info().flags:
            pytest.fail("this CPU cannot run an AVX2 build")
        lib = kernels._library(request.param)
        # Built without AVX-512: vectors of 8, so a 32-wide value is whole tiles of 4 vectors.
        assert lib is not None and lib.prefill_attention_supports(8, 32)
        monkeypatch.setattr(kernels, "_library", lambda march="native": lib)
    return request.param
