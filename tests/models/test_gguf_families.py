"""GGUF files of the Llama family as llama.cpp's own converter writes them (helpers/llama_cpp.py)
from tiny random transformers checkpoints: Llama 3.x (the llama3 rope, which the file keeps as
its rope_freqs.weight factors), Qwen2 (QKV bias, Q and K rows not permuted), Qwen3 (q/k norm),
at F32 and Q8_0, against transformers on the checkpoint itself:

- the description read from the file is the checkpoint's (the llama3 rope's parameters recovered
  exactly), so the model's arithmetic is transformers' own;
- F32: prompt logprobs on fixed token ids, argmax equal and the top token's logprob within 1e-3;
- Q8_0: the same against transformers with the weights transformers' own GGUF loader dequantizes
  from the file; with the blocks kept (quantization="gguf", int8 activations) within the
  rounding tests/models/test_quantized_gguf.py bounds;
- two ranks (PCP) give the bits of one; P = D = 2 (DCP) its tokens, logprobs within DCP's bound.

Mistral v0.3 (a llama file to llama.cpp) runs from either as Llama does (v0.1's sliding window:
tests/models/test_sliding_window.py); architectures or GGUF tensor types ctxpar does not read are
refused naming them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError
from ctxpar.model_args import RopeScaling
from ctxpar.models.loader import _read_config, load_model
from helpers.llama_cpp import gguf_of
from helpers.reference import SingleSequence

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
IDS = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(0))  # the tokenizer's pieces
TOL = 1e-3  # fp32: the top token's logprob against transformers'
TIE = 1e-4  # fp32: a reference top-2 gap below this is a tie either engine may break
QUANT_TOL, QUANT_GAP = 0.5, 1.0  # int8 activations (tests/models/test_quantized_gguf.py's bounds)
DCP_TOL = 2e-4  # nats: a logprob under DCP against one rank's (tests/engine/test_same_bits.py's bound)


FAMILIES = ["llama3", "qwen2", "qwen3", "mistral"]


def configs() -> dict:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama3": LlamaConfig(**COMMON, rope_parameters=LLAMA3),
        "qwen2": Qwen2Config(**COMMON),
        "qwen3": Qwen3Config(**COMMON, head_dim=32),
        "mistral": MistralConfig(**COMMON, sliding_window=None),  # v0.3: llama.cpp writes it as a llama file
    }


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """{family: (checkpoint, {outtype: GGUF file})}."""
    from helpers.models import save_tiny_model

    root = tmp_path_factory.mktemp("gguf_families")
    out = {}
    for name, config in configs().items():
        hf = peaked(save_tiny_model(config, root / name))
        out[name] = (hf, gguf_of(hf, root, ("f32",) if name == "mistral" else ("f32", "q8_0")))
    return out


def peaked(hf_dir: Path, factor: float = 16.0) -> Path:
    """The checkpoint with its lm_head times ``factor``: logits spread over several nats, so a
    top token stands clear of the next and argmax comparisons mean something."""
    from safetensors.torch import load_file, save_file

    weights = load_file(hf_dir / "model.safetensors")
    weights["lm_head.weight"] *= factor
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    return hf_dir


@torch.no_grad()
def transformers_logprobs(hf_dir: Path, gguf_file: Path | None = None) -> torch.Tensor:
    """(n, vocab) logprobs of IDS by transformers on the checkpoint, with the weights its own
    GGUF loader reads from ``gguf_file`` where given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {"dtype": torch.float32, "attn_implementation": "eager"}
    if gguf_file is None:
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
    else:  # the checkpoint's config: transformers reads neither Qwen3's head_dim nor rope_freqs from a GGUF
        config = AutoConfig.from_pretrained(hf_dir)
        ref = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, config=config, **kwargs)
    return torch.log_softmax(ref.eval()(IDS[None]).logits[0].float(), -1)


def ctxpar_logprobs(path: Path, quantization: str | None = None) -> torch.Tensor:
    model = load_model(str(path), torch.float32, torch.device("cpu"), quantization=quantization).model
    return torch.log_softmax(SingleSequence(model, 64).step(IDS), -1)


def assert_close_at_the_top(got: torch.Tensor, want: torch.Tensor, tol: float, gap: float) -> None:
    """Argmax equal wherever the reference's top two differ by more than ``gap``; the reference's
    top token's logprob within ``tol``."""
    top2 = want.topk(2, -1)
    clear = top2.values[:, 0] - top2.values[:, 1] > gap
    assert clear.sum() >= len(IDS) // 2, "too many near-ties to compare: peak the weights more"
    assert torch.equal(got.argmax(-1)[clear], top2.indices[clear, 0])
    top = top2.indices[:, :1]
    assert (got.gather(1, top) - want.gather(1, top)).abs().max() < tol


def test_the_files_describe_the_checkpoints(families) -> None:
    from ctxpar.models.gguf import config_from_gguf, open_gguf

    for name, (hf, files) in families.items():
        theirs = _read_config(hf, hf)
        for path in files.values():
            ours = config_from_gguf(open_gguf(path), path)
            assert np.float32(ours.rms_norm_eps) == np.float32(theirs.rms_norm_eps)  # the file's is a float32
            if name == "mistral":  # written as Llama, which it is with no window
                theirs = dataclasses.replace(theirs, model_type="llama", architectures=("LlamaForCausalLM",))
            assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs, name
    read = {name: _read_config(hf, hf) for name, (hf, _) in families.items()}
    assert read["llama3"].rope == RopeScaling(**LLAMA3) and read["qwen2"].qkv_bias and read["qwen3"].qk_norm


@pytest.mark.parametrize("name", FAMILIES)
def test_f32_files_match_transformers_on_the_checkpoint(families, name: str) -> None:
    hf, files = families[name]
    want = transformers_logprobs(hf)
    assert_close_at_the_top(ctxpar_logprobs(files["f32"]), want, TOL, TIE)
    assert_close_at_the_top(ctxpar_logprobs(hf), want, TOL, TIE)


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])  # transformers reads no mistral GGUF
def test_q8_0_files_match_transformers_on_their_weights(families, name: str) -> None:
    hf, files = families[name]
    assert_q8_0_file_matches_transformers(hf, files["q8_0"])


def assert_q8_0_file_matches_transformers(hf: Path, q8_0: Path) -> None:
    """A Q8_0 file dequantized (fp32's bounds) and with its blocks kept (int8 activations'
    bounds) against transformers on the file's own weights (its GGUF loader)."""
    want = transformers_logprobs(hf, q8_0)
    assert_close_at_the_top(ctxpar_logprobs(q8_0), want, TOL, TIE)
    assert_close_at_the_top(ctxpar_logprobs(q8_0, "gguf"), want, QUANT_TOL, QUANT_GAP)


def assert_ranks_give_the_bits_of_one(path: str, dcp_tol: float = DCP_TOL) -> None:
    """P = 2 gives P = 1's bits; P = D = 2 its tokens, logprobs within dcp_tol."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = {}
    for layout in ((1, 1), (2, 1), (2, 2)):
        kwargs = dict(pcp_size=layout[0], dcp_size=layout[1], pcp_min_tokens=0, max_model_len=128)
        # A float32 cache: DCP_TOL bounds float32 rounding merged in another order. The int8
        # cache a GGUF gets by default is read by the int8 prefill kernel where it takes the
        # heads (qwen3's 32 wide on AVX2), which rounds a query's softmax weights per block of
        # its keys (tests/helpers/attention_reference.py's int8_bounds): a shard's blocks are
        # not one rank's, and this peaked model turns that ~1e-4 into ~1e-2 nats.
        with LLM(path, kv_cache_bytes=1 << 22, kv_cache_dtype="model", **kwargs) as llm:
            outs[layout] = llm.generate([{"prompt_token_ids": IDS.tolist()}], params, use_tqdm=False)[0]
    one, two, dcp = outs[1, 1], outs[2, 1], outs[2, 2]
    assert two.outputs[0].token_ids == one.outputs[0].token_ids == dcp.outputs[0].token_ids
    assert two.outputs[0].logprobs == one.outputs[0].logprobs and two.prompt_logprobs == one.prompt_logprobs
    pairs = [*zip(dcp.outputs[0].logprobs, one.outputs[0].logprobs), *zip(dcp.prompt_logprobs, one.prompt_logprobs)]
    worst = max(abs(a[t].logprob - b[t].logprob) for a, b in pairs if a and b for t in a.keys() & b.keys())
    assert worst < dcp_tol, worst


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])  # mistral's file is a llama one
def test_two_ranks_give_the_bits_of_one_and_dcp_its_tokens(families, name: str) -> None:
    """P = 2: the bits of P = 1. P = D = 2: a query's attention merged from its two shards,
    another summation order (README, "The same bits whatever else runs"): the same tokens,
    logprobs within DCP_TOL (tests/engine/test_same_bits.py's bound)."""
    assert_ranks_give_the_bits_of_one(str(families[name][1]["f32"]))


def write_gguf(path: Path, arch: str, tensor: np.ndarray) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unread_architectures_and_tensor_types_are_named(tmp_path: Path) -> None:
    (tmp_path / "falcon").mkdir()
    (tmp_path / "falcon" / "config.json").write_text(
        json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon", "parallel_attn": True})
    )
    with pytest.raises(CtxparError, match=r"architecture 'FalconForCausalLM'; supported: .*MistralForCausalLM"):
        load_model(str(tmp_path / "falcon"), torch.float32, torch.device("cpu"))
    falcon = write_gguf(tmp_path / "falcon.gguf", "falcon", np.zeros((4, 32), np.float32))
    with pytest.raises(CtxparError, match=r"architecture 'falcon', which ctxpar does not run; .* llama, qwen2, qwen3"):
        load_model(str(falcon), torch.float32, torch.device("cpu"))
    f64 = write_gguf(tmp_path / "f64.gguf", "llama", np.zeros((4, 32), np.float64))
    with pytest.raises(CtxparError, match=r"tensors of type F64, which ctxpar does not read; it reads Q8_0, .*BF16"):
        load_model(str(f64), torch.float32, torch.device("cpu"))


def test_a_rope_freqs_tensor_not_llama3s_is_refused() -> None:
    from ctxpar.models.gguf_config import llama3_factors, llama3_rope

    factors = llama3_factors(500000.0, 16, 8.0, 1.0, 4.0, 64)
    assert llama3_rope(factors, 500000.0, 16, Path("f")) == RopeScaling(**LLAMA3)
    assert llama3_rope(torch.ones(8), 500000.0, 16, Path("f")) == RopeScaling(rope_theta=500000.0)
    with pytest.raises(CtxparError, match="not a llama3 rope's"):
        llama3_rope(factors * 1.5, 500000.0, 16, Path("f"))
