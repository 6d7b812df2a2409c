"""bench/gguf_shapes.py's random-weight GGUFs, each in its family's own architecture (llama,
qwen3, gemma3): ctxpar reads each as that family (q/k norms, Gemma 3's extra norms, window and
tied head) and generates from it; llama.cpp (its own venv, skipped where there is none) loads
the same file and gives ctxpar's logprobs within its int8 activations' rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ctxpar import LLM, SamplingParams
from ctxpar.bench import gguf_shapes
from ctxpar.bench.gguf_shapes import Shape, is_written, write_gguf
from ctxpar.errors import CtxparError
from ctxpar.models.gguf_config import config_from_gguf
from ctxpar.models.gguf_file import GGUFFile
from ctxpar.models.loader import default_model_path, load_model
from helpers.llama_cpp_runtime import llama_cpp_logits, python, skip_reason
from helpers.reference import SingleSequence

# A 2-layer shape of each family, written in seconds; Gemma 3's window shorter than the prompt.
TINY = {
    "llama": Shape(256, 2, 4, 2, 64, 512, 10000.0, tied=False),
    "qwen3": Shape(256, 2, 4, 2, 64, 512, 1000000.0, tied=True, arch="qwen3"),
    "gemma3": Shape(256, 2, 4, 1, 64, 512, 1000000.0, tied=True, arch="gemma3", window=4),
}
MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}
IDS = [1, 200, 3000, 45, 999, 12, 7000, 31]
LLAMA_CPP_TOL = 0.05  # its Q4_0 matmuls round the activations to int8 blocks; ctxpar's float path does not


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("shapes")
    with pytest.MonkeyPatch.context() as mp:
        for arch, shape in TINY.items():
            mp.setitem(gguf_shapes.SHAPES, f"tiny-{arch}", shape)
        return {a: write_gguf(f"tiny-{a}", "Q4_0", folder / f"{a}.gguf", default_model_path()) for a in TINY}


@pytest.mark.parametrize("arch", list(TINY))
def test_each_family_is_written_and_read_as_its_own(files: dict[str, Path], arch: str) -> None:
    shape, path = TINY[arch], files[arch]
    reader = GGUFFile(path)
    args = config_from_gguf(reader, path)
    assert reader.metadata["general.architecture"] == arch and args.model_type == MODEL_TYPES[arch]
    assert args.qk_norm == (arch != "llama") and args.tie_word_embeddings == shape.tied
    assert args.head_dim == shape.head_dim and args.num_key_value_heads == shape.kv_heads
    norms = {t.name: t.shape for t in reader.tensors if t.name.startswith("blk.1.") and "norm" in t.name}
    extra = {"llama": {}, "qwen3": {"attn_q_norm": 64, "attn_k_norm": 64}}
    extra["gemma3"] = {**extra["qwen3"], "post_attention_norm": 256, "post_ffw_norm": 256}
    assert norms == {f"blk.1.{n}.weight": (d,) for n, d in {"attn_norm": 256, "ffn_norm": 256, **extra[arch]}.items()}
    if arch == "gemma3":  # llama.cpp's pattern: 5 windowed layers, then one in full
        assert args.sliding_window == 4 and args.layer_types == ("sliding_attention",) * 2
        # Every norm multiplies by 1: the file's 1 + w is 1.0 (w = 0), held as the factor 1 + w.
        weights = dict(load_model(str(path), torch.float32, torch.device("cpu")).model.named_parameters())
        gemma_norms = [w for n, w in weights.items() if n.endswith("norm.weight")]
        assert len(gemma_norms) == 2 * 6 + 1 and all(torch.equal(w, torch.ones_like(w)) for w in gemma_norms)
    with LLM(model=str(path), quantization="gguf", max_model_len=64, kv_cache_bytes=1 << 22) as llm:
        out = llm.generate({"prompt_token_ids": IDS}, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_llama_cpp_runs_each_family_as_ctxpar_does(files: dict[str, Path]) -> None:
    interpreter = python()
    if interpreter is None:
        pytest.skip(skip_reason())
    for arch, path in files.items():
        model = load_model(str(path), torch.float32, torch.device("cpu")).model
        ours = torch.log_softmax(SingleSequence(model, 64).step(torch.tensor(IDS)), -1)
        theirs = torch.log_softmax(torch.from_numpy(llama_cpp_logits(interpreter, path, IDS, 64)), -1)
        assert np.isfinite(theirs.numpy()).all(), arch
        assert (ours - theirs).abs().max() < LLAMA_CPP_TOL, arch


def test_a_format_whose_blocks_do_not_tile_the_rows_is_refused(tmp_path: Path) -> None:
    # Gemma 3 1B's hidden 1152 is 4.5 Q4_K blocks: llama.cpp's quantize writes those rows in Q5_0.
    with pytest.raises(CtxparError, match=r"not whole Q4_K blocks of 256; write it in Q4_0, Q8_0"):
        write_gguf("gemma3-1b", "Q4_K", tmp_path / "g.gguf", default_model_path())
    assert not (tmp_path / "g.gguf").exists()


def test_a_stale_file_of_another_architecture_is_written_again(files: dict[str, Path], monkeypatch) -> None:
    monkeypatch.setitem(gguf_shapes.SHAPES, "tiny-qwen3", TINY["qwen3"])
    assert is_written("tiny-qwen3", files["qwen3"])
    assert not is_written("tiny-qwen3", files["llama"]) and not is_written(
        "tiny-qwen3", files["qwen3"].with_suffix(".x")
    )
