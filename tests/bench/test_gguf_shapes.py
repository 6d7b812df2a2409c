"""bench/gguf_shapes.py's random-weight GGUFs, each in its family's own architecture (llama,
qwen2, qwen3, qwen3moe, phi3, gemma3, deepseek2): every tensor is one llama.cpp's converter
names for the architecture (gguf-py's MODEL_TENSORS), ctxpar reads each as that family (QKV
bias, q/k norms, fused QKV and gate|up, Gemma 3's extra norms, window and tied head, the
experts, MLA) and generates from it; llama.cpp (its own venv, skipped where there is none) loads
the same file and gives ctxpar's logprobs within its int8 activations' rounding."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ctxpar import LLM, SamplingParams
from ctxpar.bench import gguf_shapes
from ctxpar.bench.gguf_shapes import Experts, Latent, Shape, is_written, write_gguf
from ctxpar.errors import CtxparError
from ctxpar.models.gguf_config import config_from_gguf
from ctxpar.models.gguf_file import GGUFFile
from ctxpar.models.loader import default_model_path, load_model
from helpers.llama_cpp_runtime import llama_cpp_logits, python, skip_reason
from helpers.reference import SingleSequence

# A 2-layer shape of each family, written in seconds; Gemma 3's window shorter than the prompt;
# Phi-3 without one (llama.cpp's graph does not apply a phi3 file's window); DeepSeek at 27 layers,
# the count at which llama.cpp reads a file without the query's low-rank step (V2-Lite's).
TINY = {
    "llama": Shape(256, 2, 4, 2, 64, 512, 10000.0, tied=False),
    "qwen2": Shape(256, 2, 4, 2, 64, 512, 1000000.0, tied=True, arch="qwen2"),
    "qwen3": Shape(256, 2, 4, 2, 64, 512, 1000000.0, tied=True, arch="qwen3"),
    "qwen3moe": Shape(256, 2, 4, 2, 64, 512, 1000000.0, tied=False, arch="qwen3moe", experts=Experts(8, 2, 64)),
    "phi3": Shape(256, 2, 4, 4, 64, 512, 10000.0, tied=False, arch="phi3"),
    "gemma3": Shape(256, 2, 4, 1, 64, 512, 1000000.0, tied=True, arch="gemma3", window=4),
    "deepseek2": Shape(
        256,
        27,
        4,
        4,
        64,
        512,
        10000.0,
        tied=False,
        arch="deepseek2",
        experts=Experts(8, 2, 64, shared=2, dense_layers=1),
        mla=Latent(128, 32, 64),
    ),
}
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma3": "gemma3_text",
    "deepseek2": "deepseek_v2",
}
IDS = [1, 200, 3000, 45, 999, 12, 7000, 31]
LLAMA_CPP_TOL = 0.05  # its Q4_0 matmuls round the activations to int8 blocks; ctxpar's float path does not


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("shapes")
    with pytest.MonkeyPatch.context() as mp:
        for arch, shape in TINY.items():
            mp.setitem(gguf_shapes.SHAPES, f"tiny-{arch}", shape)
        return {a: write_gguf(f"tiny-{a}", "Q4_0", folder / f"{a}.gguf", default_model_path()) for a in TINY}


def converter_names(arch: str) -> set[str]:
    """The tensor names llama.cpp's converter writes for ``arch`` (gguf-py's constants.py), a layer's
    as ``blk.{bid}.``."""
    import gguf

    kind = next(k for k, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    return {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[kind]}


@pytest.mark.parametrize("arch", list(TINY))
def test_each_family_is_written_and_read_as_its_own(files: dict[str, Path], arch: str) -> None:
    shape, path = TINY[arch], files[arch]
    reader = GGUFFile(path)
    names = {t.name.rpartition(".")[0] for t in reader.tensors}
    kinds = {re.sub(r"^blk\.\d+\.", "blk.{bid}.", n) for n in names}
    assert kinds <= converter_names(arch), kinds - converter_names(arch)
    args = config_from_gguf(reader, path)
    assert reader.metadata["general.architecture"] == arch and args.model_type == MODEL_TYPES[arch]
    assert args.qk_norm == (arch in ("qwen3", "qwen3moe", "gemma3")) and args.qkv_bias == (arch == "qwen2")
    assert args.tie_word_embeddings == shape.tied and args.num_hidden_layers == shape.layers
    norms = {t.name: t.shape for t in reader.tensors if t.name.startswith("blk.1.") and "norm" in t.name}
    extra = {"qk": {"attn_q_norm": 64, "attn_k_norm": 64}, "deepseek2": {"attn_kv_a_norm": 128}}
    extra["gemma3"] = {**extra["qk"], "post_attention_norm": 256, "post_ffw_norm": 256}
    extra["qwen3"] = extra["qwen3moe"] = extra["qk"]
    wanted = {"attn_norm": 256, "ffn_norm": 256, **extra.get(arch, {})}
    assert norms == {f"blk.1.{n}.weight": (d,) for n, d in wanted.items()}
    if arch == "phi3":  # Q, K and V one tensor; gate and up one
        assert {"blk.1.attn_qkv", "blk.1.ffn_up"} <= names and "blk.1.attn_q" not in names
        # Named so that llama.cpp does not look up Phi-3's special tokens, not in SmolLM2's vocabulary.
        assert not re.search("phi-?3", reader.metadata["general.name"], re.IGNORECASE)
    if arch == "qwen3moe":
        assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (8, 2, 64)
        assert args.norm_topk_prob and args.mlp_only_layers == ()
    if arch == "deepseek2":  # MLA without the query's low-rank step; the first layer dense
        assert (args.q_lora_rank, args.kv_lora_rank, args.qk_rope_head_dim, args.v_head_dim) == (None, 128, 32, 64)
        assert (args.qk_nope_head_dim, args.n_routed_experts, args.n_shared_experts) == (64, 8, 2)
        assert args.first_k_dense_replace == 1 and "blk.0.ffn_gate_inp" not in names
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
    # Gemma 3 1B's hidden 1152 is 4.5 Q4_K blocks: llama.cpp's quantize writes those rows in Q5_0;
    # DeepSeek-V2-Lite's expert rows of 1408 are 5.5.
    with pytest.raises(CtxparError, match=r"not whole Q4_K blocks of 256; write it in Q4_0, Q8_0"):
        write_gguf("gemma3-1b", "Q4_K", tmp_path / "g.gguf", default_model_path())
    with pytest.raises(CtxparError, match=r"\(128, 512, 1408, 2048, 2816, 10944 weights\) are not whole Q4_K"):
        write_gguf("deepseek-v2-lite", "Q4_K", tmp_path / "d.gguf", default_model_path())
    assert not list(tmp_path.iterdir())


def test_a_stale_file_of_another_architecture_is_written_again(files: dict[str, Path], monkeypatch) -> None:
    monkeypatch.setitem(gguf_shapes.SHAPES, "tiny-qwen3", TINY["qwen3"])
    assert is_written("tiny-qwen3", files["qwen3"])
    assert not is_written("tiny-qwen3", files["llama"]) and not is_written(
        "tiny-qwen3", files["qwen3"].with_suffix(".x")
    )
