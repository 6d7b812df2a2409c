"""ctxpar against llama.cpp itself on the same GGUF files: every family ctxpar reads from GGUF, the
files llama.cpp's own converter writes in the family tests (their fixtures, imported here), run by
llama.cpp (helpers/llama_cpp_runtime.py: llama-cpp-python in a venv of its own; the test skips
where there is none, as in CI) on the same fixed token ids, its KV cache in F32:

- F32: argmax equal, every logprob within 1e-3 plus llama.cpp's own distance from transformers on
  the checkpoint, measured here (Gemma's GELU rounds through fp16 in llama.cpp: ~3e-3; the other
  families ~5e-5), that distance bounded too: a window or rope llama.cpp applies otherwise shows
  as nats;
- Q8_0: ctxpar with the blocks kept (int8 activations) against llama.cpp's Q8_0 matmul (which
  quantizes the activations to Q8_0 as well), within the int8 bound of the family tests: the two
  roundings swap tokens up to ~0.5 nats apart, llama.cpp's Q8_0 its own F32's up to ~1 nat.

llama.cpp tells a DeepSeek-V2 without a low-rank query (V2-Lite) by its 27 layers, and refuses the
family tests' 2-layer one: V2 is compared at 27 layers here.

The windowed families' prompts span several windows (Gemma's 16 keys, 40 tokens). llama.cpp runs
no window where ctxpar and transformers do: Mistral v0.1's file states none, and llama.cpp
disables Phi-3's though the file states it (test_llama_cpp_runs_phi3_without_its_window).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.llama_cpp import convert
from helpers.llama_cpp_runtime import llama_cpp_logits, python, skip_reason
from tests.models.test_gemma3_multimodal import multimodal  # noqa: F401
from tests.models.test_gguf_deepseek import configs as deepseek_configs
from tests.models.test_gguf_deepseek import families as deepseek_families  # noqa: F401  (fixtures)
from tests.models.test_gguf_families import (
    IDS,
    QUANT_GAP,
    QUANT_TOL,
    TIE,
    TOL,
    assert_close_at_the_top,
    ctxpar_logprobs,
    peaked,
    transformers_logprobs,
)
from tests.models.test_gguf_families import families as dense_families  # noqa: F401
from tests.models.test_gguf_gemma import gemmas  # noqa: F401
from tests.models.test_gguf_moe import families as moe_families  # noqa: F401
from tests.models.test_gguf_moe import with_bpe_tokenizer
from tests.models.test_gguf_phi3 import WINDOW, phi3  # noqa: F401
from tests.models.test_longrope import longrope  # noqa: F401
from tests.models.test_phi4_mini import phi4  # noqa: F401
from tests.models.test_sliding_window import transformers_logprobs as sliding_window_reference

N_CTX = 64  # over IDS, and over longrope's original context (32): its long factors, as ctxpar's
DRIFT = 1e-2  # llama.cpp from transformers: float rounding ~1e-5, a wrong window or rope nats
# Gemma's: llama.cpp computes GELU in fp16, whose error grows with the activations (the peaked
# models' final norm makes their logits sharp: 0.025 nats), still far below a wrong feature's.
GEMMA_DRIFT = 5e-2
V2_REFUSED = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="llama.cpp reads a deepseek2 file without q_lora_rank only at V2-Lite's 27 layers",
)
V2_LITE_LAYERS = 27  # the count by which llama.cpp tells a V2 without a low-rank query
V3_ROUTING = "Q8_0's rounding moves V3's sigmoid routing: llama.cpp's Q8_0 is 13 nats from its own F32"


def case(fixture: str, name: str | None = None, *marks: pytest.MarkDecorator):
    """A family: its family test's fixture, and the model's name there (None: the fixture is one)."""
    return pytest.param(fixture, name, marks=marks, id=f"{fixture}-{name}" if name else fixture)


F32_CASES = [
    case("dense_families", "llama3"),
    case("dense_families", "qwen2"),
    case("dense_families", "qwen3"),
    case("dense_families", "mistral"),
    case("moe_families", "qwen2moe"),
    case("moe_families", "qwen3moe"),
    case("longrope"),
    case("phi4"),  # Phi-4-mini's partial rotary
    case("gemmas", "gemma2"),
    case("gemmas", "gemma3"),
    case("multimodal"),  # Gemma 3 4B-27B's text model, from a Gemma3ForConditionalGeneration checkpoint
    case("deepseek_families", "v2", V2_REFUSED),
    case("deepseek_v2_lite", "v2"),
    case("deepseek_families", "v3"),
]
Q8_0_CASES = [
    *(
        p
        for p in F32_CASES
        if p.values[1] not in ("mistral", "v3") and p.values[0] not in ("deepseek_v2_lite", "multimodal")
    ),
    case("deepseek_families", "v3", pytest.mark.skip(reason=V3_ROUTING)),
]


@pytest.fixture(scope="module")
def interpreter() -> Path:
    found = python()
    if found is None:
        pytest.skip(skip_reason())
    return found


@pytest.fixture(scope="module")
def deepseek_v2_lite(interpreter: Path, tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """{"v2": (checkpoint, {"f32": GGUF file})}: test_gguf_deepseek's V2 at V2-Lite's layer count,
    which llama.cpp loads (its Q8_0 file is not compared: 27 layers of int8 activations drift
    0.7 nats from llama.cpp's, past the family tests' bound)."""
    from transformers import DeepseekV2Config

    from helpers.deepseek_configs import save_tiny_deepseek

    root = tmp_path_factory.mktemp("deepseek_v2_lite")
    config = DeepseekV2Config(**{**deepseek_configs()["v2"].to_dict(), "num_hidden_layers": V2_LITE_LAYERS})
    hf = with_bpe_tokenizer(peaked(save_tiny_deepseek(config, root / "v2")))
    return {"v2": (hf, {"f32": convert(hf, root / "v2-f32.gguf", "f32")})}


def model(request, fixture: str, name: str | None) -> tuple[Path, dict[str, Path]]:
    """(checkpoint, {outtype: GGUF file}), built by the family test's fixture."""
    value = request.getfixturevalue(fixture)
    return value if name is None else value[name]


def llama_cpp_logprobs(interpreter: Path, path: Path) -> torch.Tensor:
    """(n, vocab) float64 logprobs of IDS by llama.cpp on ``path``."""
    logits = torch.from_numpy(llama_cpp_logits(interpreter, path, IDS.tolist(), N_CTX))
    return torch.log_softmax(logits.double(), -1)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Argmax equal where ``want``'s top two stand clear; every logprob within ``tol``."""
    assert_close_at_the_top(got, want, tol, TIE)
    assert (got - want).abs().max() < tol


@pytest.mark.parametrize("fixture, name", F32_CASES)
def test_f32_files_match_llama_cpp(request, interpreter: Path, fixture: str, name: str | None) -> None:
    hf, files = model(request, fixture, name)
    theirs = llama_cpp_logprobs(interpreter, files["f32"])
    drift = (theirs - transformers_logprobs(hf).double()).abs().max().item()
    assert drift < (GEMMA_DRIFT if fixture == "gemmas" else DRIFT), f"llama.cpp is {drift:.3g} nats from transformers"
    assert_close(ctxpar_logprobs(files["f32"]).double(), theirs, TOL + drift)


@pytest.mark.parametrize("fixture, name", Q8_0_CASES)
def test_q8_0_files_with_their_blocks_kept_match_llama_cpp(
    request, interpreter: Path, fixture: str, name: str | None
) -> None:
    _, files = model(request, fixture, name)
    theirs = llama_cpp_logprobs(interpreter, files["q8_0"])
    assert_close_at_the_top(ctxpar_logprobs(files["q8_0"], "gguf").double(), theirs, QUANT_TOL, QUANT_GAP)


def test_llama_cpp_runs_phi3_without_its_window(interpreter: Path, phi3) -> None:  # noqa: F811
    """llama.cpp reads phi3.attention.sliding_window and disables it ("Phi SWA is currently
    disabled", its PR 13676): its logprobs are transformers' on the checkpoint without the window,
    nats from those with it, which ctxpar's are (tests/models/test_gguf_phi3.py). Within the first
    window, where it does not bite, ctxpar's equal llama.cpp's."""
    hf, files = phi3
    theirs = llama_cpp_logprobs(interpreter, files["f32"])
    assert (theirs - sliding_window_reference(hf, IDS, window=False).double()).abs().max() < TOL
    ours = ctxpar_logprobs(files["f32"]).double()
    assert (ours - transformers_logprobs(hf).double()).abs().max() < TOL
    assert (ours - theirs).abs().max() > 1.0
    assert (ours[:WINDOW] - theirs[:WINDOW]).abs().max() < TOL
