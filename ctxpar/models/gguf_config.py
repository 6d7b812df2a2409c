"""A GGUF file's model description (ctxpar/model_args.py) from its metadata, as
llama.cpp's converter (convert_hf_to_gguf.py) writes it: the architecture, the
shapes, the rope (base; Llama 3's scaling from the ``rope_freqs`` tensor, Phi-3's longrope from
``rope_factors_short``/``_long``), the experts (Qwen-MoE; DeepSeek's MLA and router: gguf_mla.py),
the token ids; and the check that every tensor is of a type ctxpar reads."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ctxpar.errors import CtxparError
from ctxpar.layers.quant_blocks import FORMATS
from ctxpar.model_args import ModelArgs, RopeScaling
from ctxpar.models.gguf_file import GGUFFile
from ctxpar.models.gguf_mla import mla_fields, yarn_rope

# general.architecture -> (model_type, Hugging Face architecture): the families ctxpar runs from GGUF.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),  # Llama 1-3.x, Mistral v0.3, SmolLM2
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),  # Qwen2, Qwen2.5 (QKV bias)
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),  # Qwen3 dense (q/k norm)
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),  # Qwen1.5-MoE, Qwen2-57B-A14B (QKV bias, gated shared expert)
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),  # Qwen3-30B-A3B, Qwen3-235B-A22B (q/k norm)
    "phi3": ("phi3", "Phi3ForCausalLM"),  # Phi-3, Phi-3.5 (fused QKV and gate|up; longrope's factors)
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),  # Gemma 2 (soft-caps, every other layer windowed)
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),  # Gemma 3's text model (q/k norm, two rope bases)
    "deepseek2": ("deepseek_v2", "DeepseekV2ForCausalLM"),  # DeepSeek-V2/V3 (MLA; V3 by its router: gguf_mla.py)
}
# Gemma: a norm on each side of attention and MLP (ffn_norm the one before the MLP), each norm's
# factor 1 + w in the file (the converter adds 1 to the checkpoint's w), and llama.cpp's settings
# the files do not state: every n-th layer attends in full, the others in the window (Gemma 3's
# with a rope of base 10000, unscaled); the attention's scale 1/sqrt(head_dim) but for the 27B
# models (by their layer count), whose is 1/sqrt(hidden / heads); Gemma 2's soft-caps 50 and 30.
GEMMA = ("gemma2", "gemma3")
GEMMA_FULL_EVERY = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_SOFTCAPS = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}
GEMMA_SLIDING_THETA = 10000.0
# The architectures whose ffn_up tensor is gate|up fused (Hugging Face's gate_up_proj).
FUSED_GATE_UP = ("phi3",)
# The MoE architectures, each with whether its chosen experts' weights are renormalised to sum
# to 1: llama.cpp's choice for each, fixed in its graph (src/models/qwen2moe.cpp, qwen3moe.cpp),
# which reads no {arch}.expert_weights_norm (the converter writes none for them; Qwen3-MoE's
# checkpoints set norm_topk_prob, Qwen2-MoE's do not).
MOE_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}
# The architectures whose Q and K rows llama.cpp's converter permutes for its rope (LlamaModel's
# permute); the others (Qwen) keep Hugging Face's row order.
PERMUTED_QK = ("llama",)
# Tensor types read: the block formats kept quantized (layers/quant_blocks.py), and those
# dequantized to float when loading (gguf-py's reference decoders; BF16 weights are kept as
# the file's bf16 where the blocks are kept: models/gguf.py).
DEQUANTIZED = ("F32", "F16", "BF16")
TENSOR_TYPES = (*FORMATS, *DEQUANTIZED)
# Llama 3.x's llama3 rope: its low and high frequency factors, and the context it was trained at.
LLAMA3_FREQ_FACTORS = (1.0, 4.0)
LLAMA3_CONTEXT = 8192


def config_from_gguf(reader: GGUFFile, path: Path) -> ModelArgs:
    """The model's description from the GGUF metadata; CtxparError naming what ctxpar does not read."""
    meta = reader.metadata
    arch = meta.get("general.architecture")
    if arch == "clip":  # what a multimodal model's GGUF download holds beside its text model's file
        raise CtxparError(
            f"GGUF file {path} is a multimodal projector (mmproj: an image encoder, architecture 'clip'); "
            "ctxpar runs text models: pass the model's own GGUF file, which holds its text weights"
        )
    if arch not in ARCHITECTURES:
        raise CtxparError(
            f"GGUF file {path} has architecture {arch!r}, which ctxpar does not run; "
            f"it runs GGUF architectures {', '.join(ARCHITECTURES)}"
        )
    check_tensor_types(reader, path)
    model_type, hf_arch = ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CtxparError(f"GGUF file {path} lacks metadata {arch}.{key}")
        return value

    heads, hidden = get("attention.head_count"), get("embedding_length")
    vocab = meta.get(f"{arch}.vocab_size") or reader.array_lengths.get("tokenizer.ggml.tokens")
    if not vocab:
        raise CtxparError(f"GGUF file {path} states no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
    # A head's width as llama.cpp reads it (key_length, else hidden / heads); rope.dimension_count the
    # part of each head that turns (Phi-4-mini's 3/4).
    head_dim, turned = get("attention.key_length", 0) or hidden // heads, get("rope.dimension_count", 0)
    layers = get("block_count")
    window = meta.get(f"{arch}.attention.sliding_window") or None  # Phi-3's files write 0 for none
    eos = meta.get("tokenizer.ggml.eos_token_id")
    names = {t.name for t in reader.tensors}
    moe = _experts(meta, arch, get, names, layers) if arch in MOE_NORM_TOPK else {}
    gemma = _gemma(meta, arch, hidden // heads if layers == GEMMA_27B_LAYERS.get(arch) else head_dim)
    kv_heads = get("attention.head_count_kv", heads)
    if arch == "deepseek2":  # V2 or V3; a head's rope part; the query heads' count (llama.cpp writes 1)
        (model_type, hf_arch, head_dim), moe = mla_fields(meta, names, path)
        kv_heads = heads
    partial = _partial_rotary_factor(arch, turned, head_dim, path)
    try:
        return ModelArgs(
            model_type=model_type,
            architectures=(hf_arch,),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=get("context_length"),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope=dataclasses.replace(_rope(reader, arch, head_dim, path), partial_rotary_factor=partial),
            tie_word_embeddings="output.weight" not in names,
            attention_bias=model_type == "llama" and "blk.0.attn_q.bias" in names,
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and "blk.0.attn_q.bias" in names),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_window=window,
            layer_types=_layer_types(arch, layers) if window else (),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=() if eos is None else (eos,),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            **moe,
            **gemma,
        )
    except CtxparError as e:
        raise CtxparError(f"GGUF file {path}: {e}") from None


def _experts(meta: dict[str, Any], arch: str, get: Any, names: set[str], layers: int) -> dict[str, Any]:
    """A Qwen-MoE file's experts as its config.json states them: the layers without a router
    (``ffn_gate_inp``) keep the dense MLP."""
    return dict(
        num_experts=get("expert_count"),
        num_experts_per_tok=get("expert_used_count"),
        moe_intermediate_size=get("expert_feed_forward_length"),
        shared_expert_intermediate_size=meta.get(f"{arch}.expert_shared_feed_forward_length"),
        norm_topk_prob=MOE_NORM_TOPK[arch],
        decoder_sparse_step=1,
        mlp_only_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names),
    )


def _layer_types(arch: str, layers: int) -> tuple[str, ...]:
    """A windowed file's layers: Gemma's every n-th in full (GEMMA_FULL_EVERY), the others' all windowed."""
    every = GEMMA_FULL_EVERY.get(arch)
    return tuple("full_attention" if every and (i + 1) % every == 0 else "sliding_attention" for i in range(layers))


def _gemma(meta: dict[str, Any], arch: str, query_scalar: int) -> dict[str, Any]:
    """A Gemma file's settings beyond Llama's (see GEMMA), the soft-caps the file's where it states them."""
    if arch not in GEMMA:
        return {}
    attn_cap, final_cap = GEMMA_SOFTCAPS[arch]
    attn_cap = meta.get(f"{arch}.attn_logit_softcapping", attn_cap)
    final_cap = meta.get(f"{arch}.final_logit_softcapping", final_cap)
    return dict(
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=query_scalar,
        attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
        final_logit_softcapping=None if final_cap is None else float(final_cap),
        sliding_rope=RopeScaling(rope_theta=GEMMA_SLIDING_THETA) if arch == "gemma3" else None,
    )


def check_tensor_types(reader: GGUFFile, path: Path) -> None:
    """CtxparError naming the tensor types of the file that ctxpar does not read, and those it does."""
    unread = sorted({t.kind.name for t in reader.tensors} - set(TENSOR_TYPES))
    if unread:
        raise CtxparError(
            f"GGUF file {path} holds tensors of type {', '.join(unread)}, which ctxpar does not read; "
            f"it reads {', '.join(TENSOR_TYPES)}"
        )


def _partial_rotary_factor(arch: str, turned: int, head_dim: int, path: Path) -> float | None:
    """The fraction of each head the rope turns (rope.dimension_count of head_dim: Phi-4-mini's
    first 3/4, as transformers sizes them), None for the whole head (or a count not stated)."""
    if not turned or turned >= head_dim:
        return None
    factor = turned / head_dim
    if arch != "phi3" or int(head_dim * factor) != turned:
        raise CtxparError(
            f"GGUF file {path} turns {turned} of the {head_dim} dims of each head by its rope; ctxpar reads a "
            "partial rope from phi3 files (Phi-4-mini) and Hugging Face directories"
        )
    return factor


def _rope(reader: GGUFFile, arch: str, head_dim: int, path: Path) -> RopeScaling:
    meta = reader.metadata
    theta = float(meta.get(f"{arch}.rope.freq_base", RopeScaling.rope_theta))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":  # Gemma 3 4B-27B's global layers
        return RopeScaling(rope_type="linear", rope_theta=theta, factor=float(meta[f"{arch}.rope.scaling.factor"]))
    if scaling == "yarn" and arch == "deepseek2":
        return yarn_rope(meta, theta)
    if scaling != "none":
        raise CtxparError(
            f"GGUF file {path} scales its rope by {scaling!r}, which ctxpar reads only from Hugging Face "
            "directories (config.json's rope_parameters); GGUF files of Llama 3.x's llama3 rope (rope_freqs) load"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" in tensors:
        return _longrope(meta, arch, theta, tensors)
    freqs = tensors.get("rope_freqs.weight")
    if freqs is None:
        return RopeScaling(rope_theta=theta)
    factors = np.asarray(freqs.data).view(np.float32).reshape(-1)
    return llama3_rope(torch.from_numpy(factors.copy()), theta, head_dim, path)


def _longrope(meta: dict[str, Any], arch: str, theta: float, tensors: dict[str, Any]) -> RopeScaling:
    """Phi-3's longrope (Phi-3-mini-128k, Phi-3.5-mini) as its config.json stated it: the factors the
    file keeps as rope_factors_short and rope_factors_long (float32, as transformers computes with
    them), the original context, and the attention factor only where it is not the one transformers
    derives from the two contexts (the converter writes that one, rounded to float32)."""

    def factors(kind: str) -> tuple[float, ...]:
        raw = np.asarray(tensors[f"rope_factors_{kind}.weight"].data).view(np.float32).reshape(-1)
        return tuple(float(x) for x in raw)

    original = int(meta[f"{arch}.rope.scaling.original_context_length"])
    scale = int(meta[f"{arch}.context_length"]) / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    stated = float(meta.get(f"{arch}.rope.scaling.attn_factor", derived))
    return RopeScaling(
        rope_type="longrope",
        rope_theta=theta,
        original_max_position_embeddings=original,
        short_factor=factors("short"),
        long_factor=factors("long"),
        attention_factor=None if math.isclose(stated, derived, rel_tol=1e-6) else stated,
    )


def llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, context: int) -> torch.Tensor:
    """The (dim / 2,) rope_freqs llama.cpp's converter writes for a llama3 rope: 1 where a
    frequency's wavelength is under context / high, ``factor`` over context / low, and
    smoothed between, computed in float32 as the converter does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < context / high, 1.0, torch.where(wavelen > context / low, factor, mid))


def llama3_rope(factors: torch.Tensor, theta: float, dim: int, path: Path) -> RopeScaling:
    """The llama3 rope whose factors are ``factors`` (a GGUF's rope_freqs.weight), so the model
    applies it as transformers does (layers/rotary.py). The file keeps only the factors: the
    frequency factors are Llama 3.x's (LLAMA3_FREQ_FACTORS), ``factor`` the largest, and the
    trained context the one the smoothed factors solve for (or Llama 3.x's), each kept only
    if it gives the file's factors exactly."""
    factor = float(factors.max())
    if factor == 1.0:  # no frequency scaled
        return RopeScaling(rope_theta=theta)
    low, high = LLAMA3_FREQ_FACTORS
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    contexts = {LLAMA3_CONTEXT}
    for i in torch.nonzero((factors != 1.0) & (factors != factor)).flatten().tolist():
        smooth = (1 / float(factors[i]) - 1 / factor) / (1 - 1 / factor)
        contexts.add(round(2 * math.pi / float(inv_freq[i]) * (smooth * (high - low) + low)))
    for context in sorted(contexts):
        if torch.equal(llama3_factors(theta, dim, factor, low, high, context), factors):
            return RopeScaling(
                rope_type="llama3",
                rope_theta=theta,
                factor=factor,
                low_freq_factor=low,
                high_freq_factor=high,
                original_max_position_embeddings=context,
            )
    raise CtxparError(
        f"GGUF file {path}: its rope_freqs.weight is not a llama3 rope's (low and high frequency factors "
        f"{low} and {high}, factor {factor}); ctxpar reads rope_freqs only as Llama 3.x writes it"
    )
