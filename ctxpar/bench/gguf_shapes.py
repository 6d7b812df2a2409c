"""GGUF files of real models' shapes with random weights, for benchmarks at real sizes.

No download: the blocks are random bytes with scales that keep the activations
finite (weights of standard deviation ~0.02, the usual initialisation; biases and
routers, float32 as llama.cpp's quantize keeps them, the same), every norm
multiplies by 1 (a Gemma file's value is 1 + w, as llama.cpp's converter writes
it: 1.0 for w = 0), and the tokenizer (vocabulary, merges, chat template) is
SmolLM2's, copied from the default model's GGUF. Each file is of its model's own
architecture (``llama``, ``qwen2``, ``qwen3``, ``qwen3moe``, ``phi3``, ``gemma3``,
``deepseek2``: ARCHS), with the metadata and tensors llama.cpp's converter writes
for it (conversion/*.py), so ctxpar and llama.cpp both run the family's own graph
(Qwen2's QKV bias, q/k norms, Phi-3's fused QKV and gate|up, Gemma 3's extra norms
and window, the experts, DeepSeek's MLA); only the vocabulary is not the named
model's, and the MoE shapes keep a few of their layers (their names say how many).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxpar.errors import CtxparError

SCALE = 0.02  # the weights' standard deviation


@dataclass(frozen=True)
class Arch:
    """What a family's file holds beyond a Llama file's (llama.cpp's converter, conversion/*.py)."""

    rms_eps: float
    head_norms: tuple[str, ...] = ()  # per-layer norms of head_dim (q/k norm)
    hidden_norms: tuple[str, ...] = ()  # per-layer norms of hidden beyond attn_norm and ffn_norm
    qkv_bias: bool = False  # attn_q/k/v.bias (Qwen2)
    fused: bool = False  # attn_qkv one tensor, ffn_up gate|up (Phi-3)


ARCHS: dict[str, Arch] = {
    "llama": Arch(1e-5),
    "qwen2": Arch(1e-6, qkv_bias=True),
    "qwen3": Arch(1e-6, head_norms=("attn_q_norm", "attn_k_norm")),
    "qwen3moe": Arch(1e-6, head_norms=("attn_q_norm", "attn_k_norm")),
    "phi3": Arch(1e-5, fused=True),
    # Gemma 3: a norm after attention and after the MLP too; its window's pattern (5 windowed
    # layers : 1 full) and the windowed layers' rope base (10000) are llama.cpp's, not the file's.
    "gemma3": Arch(
        1e-6, head_norms=("attn_q_norm", "attn_k_norm"), hidden_norms=("post_attention_norm", "post_ffw_norm")
    ),
    "deepseek2": Arch(1e-6),
}


@dataclass(frozen=True)
class Experts:
    """An MoE model's experts (llama.cpp's {arch}.expert_* metadata)."""

    count: int
    used: int  # chosen per token
    ffn: int  # an expert's intermediate size
    shared: int = 0  # experts every token runs, one MLP of shared * ffn (DeepSeek)
    dense_layers: int = 0  # leading layers with the dense MLP of Shape.ffn (DeepSeek's first_k_dense_replace)


@dataclass(frozen=True)
class Latent:
    """DeepSeek's multi-head latent attention (no query low-rank step: V2-Lite's); a head's
    key is Shape.head_dim (its unrotated part) + rope_dim."""

    kv_rank: int  # kv_lora_rank: the latent the cache keeps
    rope_dim: int  # qk_rope_head_dim
    v_dim: int  # v_head_dim


@dataclass(frozen=True)
class Shape:
    """A decoder's shapes: what the GGUF's {arch}.* metadata and tensors need."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float  # the full-attention layers' base
    tied: bool  # the lm_head is the embedding table
    arch: str = "llama"  # general.architecture: a key of ARCHS
    window: int | None = None  # {arch}.attention.sliding_window: the windowed layers' keys
    experts: Experts | None = None
    mla: Latent | None = None

    def params(self, vocab: int) -> int:
        """Weights in the file (norms, biases and routers aside)."""
        return sum(int(np.prod(dims)) for _, dims, fill in tensors(self, vocab) if fill == BLOCKS)


SHAPES: dict[str, Shape] = {
    # SmolLM2-135M's shape with a 128K context (the model's own is 8K): its decode after 16K tokens.
    "smollm2-135m": Shape(576, 30, 9, 3, 64, 1536, 100000.0, tied=True),
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 64, 8192, 500000.0, tied=True),
    "qwen2.5-1.5b": Shape(1536, 28, 12, 2, 128, 8960, 1000000.0, tied=True, arch="qwen2"),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 128, 6144, 1000000.0, tied=True, arch="qwen3"),
    "gemma3-1b": Shape(1152, 26, 4, 1, 256, 6912, 1000000.0, tied=True, arch="gemma3", window=512),
    # Phi-3-mini-4k: its files state a window of 2047, which llama.cpp's graph does not apply.
    "phi-3-mini": Shape(3072, 32, 32, 32, 96, 8192, 10000.0, tied=False, arch="phi3", window=2047),
    # Qwen3-30B-A3B's layers, 6 of its 48 (the whole would not fit beside other work): per token
    # each layer's work is the model's.
    "qwen3-30b-a3b-6-layers": Shape(
        2048, 6, 32, 4, 128, 6144, 1000000.0, tied=False, arch="qwen3moe", experts=Experts(128, 8, 768)
    ),
    # All 27 layers: llama.cpp reads a deepseek2 file without a query low-rank step (V2-Lite's)
    # only at 26 or 27 layers. Its yarn rope left out (the same work).
    "deepseek-v2-lite": Shape(
        2048,
        27,
        16,
        16,
        128,
        10944,
        10000.0,
        tied=False,
        arch="deepseek2",
        experts=Experts(64, 6, 1408, shared=2, dense_layers=1),
        mla=Latent(512, 64, 128),
    ),
    "llama-3-8b": Shape(4096, 32, 32, 8, 128, 14336, 500000.0, tied=False),
}
# name: (weights per block, bytes per block); the block's byte layout is ggml-common.h's.
FORMATS = {"Q4_0": (32, 18), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}
# How a tensor is filled: norms with 1, biases and routers with float32 noise, the rest with blocks.
ONES, NOISE, BLOCKS = "ones", "noise", "blocks"
Tensor = tuple[str, tuple[int, ...], str]  # (gguf name, dims outermost first: the last a row, fill)


def tensors(s: Shape, vocab: int) -> list[Tensor]:
    """Every tensor of SHAPES' shape ``s``, in the file's order, named and shaped as llama.cpp's
    converter writes its family's (gguf-py's constants.py: MODEL_TENSORS)."""
    arch = ARCHS[s.arch]
    out: list[Tensor] = [("token_embd.weight", (vocab, s.hidden), BLOCKS)]
    for i in range(s.layers):
        b = f"blk.{i}."
        norms = [("attn_norm", s.hidden), ("ffn_norm", s.hidden)]
        norms += [(n, s.head_dim) for n in arch.head_norms] + [(n, s.hidden) for n in arch.hidden_norms]
        out += [(f"{b}{n}.weight", (rows,), ONES) for n, rows in norms]
        out += [(b + name, dims, fill) for name, dims, fill in _attention(s, arch) + _mlp(s, arch, i)]
    out.append(("output_norm.weight", (s.hidden,), ONES))
    if not s.tied:
        out.append(("output.weight", (vocab, s.hidden), BLOCKS))
    return out


def _attention(s: Shape, arch: Arch) -> list[Tensor]:
    """A layer's attention tensors: Q, K, V (fused in Phi-3, biased in Qwen2) or MLA's, and the output."""
    if s.mla is not None:  # the converter splits kv_b_proj: K's part transposed, per head
        m = s.mla
        return [
            ("attn_q.weight", (s.heads * (s.head_dim + m.rope_dim), s.hidden), BLOCKS),
            ("attn_kv_a_mqa.weight", (m.kv_rank + m.rope_dim, s.hidden), BLOCKS),
            ("attn_kv_a_norm.weight", (m.kv_rank,), ONES),
            ("attn_k_b.weight", (s.heads, m.kv_rank, s.head_dim), BLOCKS),
            ("attn_v_b.weight", (s.heads, m.v_dim, m.kv_rank), BLOCKS),
            ("attn_output.weight", (s.hidden, s.heads * m.v_dim), BLOCKS),
        ]
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    qkv: list[Tensor]
    if arch.fused:
        qkv = [("attn_qkv.weight", (q_rows + 2 * kv_rows, s.hidden), BLOCKS)]
    else:
        qkv = [(f"attn_{p}.weight", (rows, s.hidden), BLOCKS) for p, rows in zip("qkv", (q_rows, kv_rows, kv_rows))]
    if arch.qkv_bias:
        qkv += [(f"attn_{p}.bias", (rows,), NOISE) for p, rows in zip("qkv", (q_rows, kv_rows, kv_rows))]
    return [*qkv, ("attn_output.weight", (s.hidden, q_rows), BLOCKS)]


def _mlp(s: Shape, arch: Arch, layer: int) -> list[Tensor]:
    """Layer ``layer``'s MLP: the dense one (gate|up fused in Phi-3), or the router, the experts
    (one 3-D tensor a projection) and the shared experts."""
    e = s.experts
    if e is None or layer < e.dense_layers:
        if arch.fused:
            return [("ffn_up.weight", (2 * s.ffn, s.hidden), BLOCKS), ("ffn_down.weight", (s.hidden, s.ffn), BLOCKS)]
        up = [(f"ffn_{p}.weight", (s.ffn, s.hidden), BLOCKS) for p in ("gate", "up")]
        return [*up, ("ffn_down.weight", (s.hidden, s.ffn), BLOCKS)]
    out: list[Tensor] = [("ffn_gate_inp.weight", (e.count, s.hidden), NOISE)]
    out += [(f"ffn_{p}_exps.weight", (e.count, e.ffn, s.hidden), BLOCKS) for p in ("gate", "up")]
    out.append(("ffn_down_exps.weight", (e.count, s.hidden, e.ffn), BLOCKS))
    if e.shared:
        out += [(f"ffn_{p}_shexp.weight", (e.shared * e.ffn, s.hidden), BLOCKS) for p in ("gate", "up")]
        out.append(("ffn_down_shexp.weight", (s.hidden, e.shared * e.ffn), BLOCKS))
    return out


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, cols / block * nbytes) uint8: random integers, scales giving weights of std ~SCALE."""
    block, nbytes = FORMATS[fmt]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    if fmt == "Q4_0":  # d * (q - 8), q uniform in 0..15: std 4.6 d
        raw[:, :, 0:2] = _halves(SCALE / 4.6, raw.shape[:2])
    elif fmt == "Q8_0":  # d * q, q uniform in -128..127: std 74 d
        raw[:, :, 0:2] = _halves(SCALE / 74, raw.shape[:2])
    elif fmt == "Q6_K":  # d * sc * (q - 32): int8 sc (std 74) at bytes 192..207, q - 32 std 18.5, d last
        raw[:, :, 208:210] = _halves(SCALE / (74 * 18.5), raw.shape[:2])
    else:  # Q4_K: d * sc * q - dmin * m, 6-bit sc and m (~32), q in 0..15
        raw[:, :, 0:2] = _halves(SCALE / (32 * 4.6), raw.shape[:2])
        raw[:, :, 2:4] = _halves(SCALE * 7.5 / (32 * 4.6), raw.shape[:2])  # dmin = 7.5 d: mean ~0
    return raw.reshape(rows, -1)


def _halves(value: float, shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, value, dtype=np.float16).view(np.uint8).reshape(*shape, 2)


def is_written(name: str, path: Path) -> bool:
    """Whether ``path`` holds a GGUF of SHAPES[name]'s architecture (one of another, a stale
    file of the same name, is to be written again)."""
    from ctxpar.models.gguf_file import GGUFFile

    return path.exists() and GGUFFile(path).metadata.get("general.architecture") == SHAPES[name].arch


def write_gguf(name: str, fmt: str, path: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write the GGUF of SHAPES[name] in block format ``fmt`` to ``path``,
    streaming one tensor at a time (memory stays one tensor's size)."""
    import gguf

    if name not in SHAPES or fmt not in FORMATS:
        raise CtxparError(f"unknown shape {name!r} or format {fmt!r}: shapes {list(SHAPES)}, formats {list(FORMATS)}")
    s, block = SHAPES[name], FORMATS[fmt][0]
    stat = tokenizer_from.stat()
    tokenizer = _tokenizer_fields(tokenizer_from.resolve(), stat.st_mtime_ns, stat.st_size)
    vocab = next(len(value) for key, value, _, _ in tokenizer if key == "tokenizer.ggml.tokens")
    layout = tensors(s, vocab)
    widths = sorted({dims[-1] for _, dims, fill in layout if fill == BLOCKS})
    fits = [f for f, (n, _) in FORMATS.items() if all(w % n == 0 for w in widths)]
    if fmt not in fits:  # llama.cpp's quantize writes such rows in another type; a benchmark of fmt should not
        raise CtxparError(
            f"shape {name}'s rows ({', '.join(map(str, widths))} weights) are not whole "
            f"{fmt} blocks of {block}; write it in {', '.join(fits)}"
        )
    w = gguf.GGUFWriter(path, s.arch)
    # Not named as llama.cpp's loader knows Phi-3 files ("phi-3", "phi3"): it would look up Phi-3's
    # special tokens (</s>, <unk>, <s>, <|endoftext|>) to mark them, which SmolLM2's vocabulary has not.
    w.add_name(re.sub("phi-?3", "phi 3", f"{name} (random weights)", flags=re.IGNORECASE))
    _add_metadata(w, s, vocab)
    for key, value, kind, sub_type in tokenizer:
        w.add_key_value(key, value, kind, sub_type=sub_type)
    kind, nbytes = gguf.GGMLQuantizationType[fmt], FORMATS[fmt][1]
    for tname, dims, fill in layout:
        if fill == BLOCKS:
            shape = (*dims[:-1], dims[-1] // block * nbytes)  # bytes: the writer turns them into weights
            w.add_tensor_info(tname, shape, np.dtype(np.uint8), int(np.prod(shape)), raw_dtype=kind)
        else:
            w.add_tensor_info(tname, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims, fill in layout:
        if fill == ONES:
            w.write_tensor_data(np.ones(dims, np.float32))
        elif fill == NOISE:
            w.write_tensor_data((rng.standard_normal(dims, dtype=np.float32) * SCALE).astype(np.float32))
        else:  # a 3-D tensor's matrices, each a (rows, cols) of blocks
            rows = int(np.prod(dims[:-1]))
            w.write_tensor_data(random_blocks(fmt, rows, dims[-1], rng).reshape(*dims[:-1], -1))
    w.close()
    return path


def _add_metadata(w, s: Shape, vocab: int) -> None:
    """The {arch}.* keys llama.cpp's converter writes for ``s``'s family."""
    import gguf

    arch = ARCHS[s.arch]
    w.add_context_length(4096 if s.arch == "phi3" else 131072)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_layer_norm_rms_eps(arch.rms_eps)
    w.add_rope_freq_base(s.rope_theta)
    w.add_vocab_size(vocab)
    if s.window is not None:
        w.add_sliding_window(s.window)
    if s.arch == "phi3":  # its converter's; no rope_factors: a 4K model's rope is unscaled
        w.add_rope_scaling_orig_ctx_len(4096)
    if s.mla is None:
        w.add_head_count_kv(s.kv_heads)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_rope_dimension_count(s.head_dim)
    else:  # llama.cpp's view of the latent as one key/value head of kv_rank (+ the rope's part)
        m = s.mla
        w.add_head_count_kv(1)
        w.add_kv_lora_rank(m.kv_rank)
        w.add_key_length(m.kv_rank + m.rope_dim)
        w.add_value_length(m.kv_rank)
        w.add_key_length_mla(s.head_dim + m.rope_dim)
        w.add_value_length_mla(m.v_dim)
        w.add_rope_dimension_count(m.rope_dim)
    e = s.experts
    if e is not None:
        w.add_expert_count(e.count)
        w.add_expert_used_count(e.used)
        w.add_expert_feed_forward_length(e.ffn)
    if s.arch == "deepseek2" and e is not None:  # V2-Lite's router: softmax, unscaled, not renormalised
        w.add_leading_dense_block_count(e.dense_layers)
        w.add_expert_shared_count(e.shared)
        w.add_expert_weights_scale(1.0)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)


@functools.lru_cache(maxsize=1)
def _tokenizer_fields(path: Path, mtime_ns: int, size: int) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array element type) of every tokenizer.* field of the GGUF at ``path``
    (SmolLM2's vocabulary, merges, special ids, chat template); kept for the same file (path,
    mtime and size) because gguf-py takes seconds to parse 49K tokens and as many merges, and
    benchmarks and tests write several files from one."""
    import gguf
    from gguf import GGUFValueType

    fields = []
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            fields.append((key, field.contents(), kind, field.types[-1] if kind == GGUFValueType.ARRAY else None))
    return fields
