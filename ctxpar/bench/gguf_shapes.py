"""GGUF files of real models' shapes with random weights, for benchmarks at real sizes.

No download: the blocks are random bytes with scales that keep the activations
finite (weights of standard deviation ~0.02, the usual initialisation), every
norm multiplies by 1 (a Gemma file's value is 1 + w, as llama.cpp's converter
writes it: 1.0 for w = 0), and the tokenizer (vocabulary, merges, chat template)
is SmolLM2's, copied from the default model's GGUF. Each file is of its model's
own architecture (``llama``, ``qwen3``, ``gemma3``: ARCHS), with the metadata and
tensors llama.cpp's converter writes for it, so ctxpar and llama.cpp both run the
family's own graph (Qwen3's and Gemma 3's q/k norms, Gemma 3's extra norms and
window); only the vocabulary is not the named model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctxpar.errors import CtxparError

SCALE = 0.02  # the weights' standard deviation


@dataclass(frozen=True)
class Arch:
    """What a family's file holds beyond a Llama file's (llama.cpp's converter, conversion/*.py)."""

    rms_eps: float
    head_norms: tuple[str, ...] = ()  # per-layer norms of head_dim (q/k norm)
    hidden_norms: tuple[str, ...] = ()  # per-layer norms of hidden beyond attn_norm and ffn_norm


ARCHS: dict[str, Arch] = {
    "llama": Arch(1e-5),
    "qwen3": Arch(1e-6, head_norms=("attn_q_norm", "attn_k_norm")),
    # Gemma 3: a norm after attention and after the MLP too; its window's pattern (5 windowed
    # layers : 1 full) and the windowed layers' rope base (10000) are llama.cpp's, not the file's.
    "gemma3": Arch(
        1e-6, head_norms=("attn_q_norm", "attn_k_norm"), hidden_norms=("post_attention_norm", "post_ffw_norm")
    ),
}


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

    def params(self, vocab: int) -> int:
        """Weights in the file (the norms aside)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attn + 3 * self.hidden * self.ffn
        return self.layers * per_layer + vocab * self.hidden * (1 if self.tied else 2)


SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 64, 8192, 500000.0, tied=True),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 128, 6144, 1000000.0, tied=True, arch="qwen3"),
    "gemma3-1b": Shape(1152, 26, 4, 1, 256, 6912, 1000000.0, tied=True, arch="gemma3", window=512),
    "llama-3-8b": Shape(4096, 32, 32, 8, 128, 14336, 500000.0, tied=False),
}
# name: (weights per block, bytes per block); the block's byte layout is ggml-common.h's.
FORMATS = {"Q4_0": (32, 18), "Q8_0": (32, 34), "Q4_K": (256, 144)}


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, cols / block * nbytes) uint8: random integers, scales giving weights of std ~SCALE."""
    block, nbytes = FORMATS[fmt]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    if fmt == "Q4_0":  # d * (q - 8), q uniform in 0..15: std 4.6 d
        raw[:, :, 0:2] = _halves(SCALE / 4.6, raw.shape[:2])
    elif fmt == "Q8_0":  # d * q, q uniform in -128..127: std 74 d
        raw[:, :, 0:2] = _halves(SCALE / 74, raw.shape[:2])
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
    s = SHAPES[name]
    arch, block = ARCHS[s.arch], FORMATS[fmt][0]
    fits = [f for f, (n, _) in FORMATS.items() if not (s.hidden % n or s.ffn % n or s.heads * s.head_dim % n)]
    if fmt not in fits:  # llama.cpp's quantize writes such rows in another type; a benchmark of fmt should not
        raise CtxparError(
            f"shape {name}'s rows ({s.hidden}, {s.ffn}, {s.heads * s.head_dim} weights) are not whole "
            f"{fmt} blocks of {block}; write it in {', '.join(fits)}"
        )
    reader = gguf.GGUFReader(tokenizer_from)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(path, s.arch)
    w.add_name(f"{name} (random weights)")
    w.add_context_length(131072)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(arch.rms_eps)
    if s.window is not None:
        w.add_sliding_window(s.window)
    w.add_vocab_size(vocab)
    _copy_tokenizer(reader, w)

    # (gguf name, rows, cols) of every tensor, in the file's order; cols None: a norm.
    tensors: list[tuple[str, int, int | None]] = [("token_embd.weight", vocab, s.hidden)]
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        b = f"blk.{i}."
        norms = [("attn_norm", s.hidden), ("ffn_norm", s.hidden)]
        norms += [(n, s.head_dim) for n in arch.head_norms] + [(n, s.hidden) for n in arch.hidden_norms]
        tensors += [(f"{b}{n}.weight", rows, None) for n, rows in norms]
        tensors += [(b + "attn_q.weight", q_rows, s.hidden), (b + "attn_k.weight", kv_rows, s.hidden)]
        tensors += [(b + "attn_v.weight", kv_rows, s.hidden), (b + "attn_output.weight", s.hidden, q_rows)]
        tensors += [(b + "ffn_gate.weight", s.ffn, s.hidden), (b + "ffn_up.weight", s.ffn, s.hidden)]
        tensors += [(b + "ffn_down.weight", s.hidden, s.ffn)]
    tensors.append(("output_norm.weight", s.hidden, None))
    if not s.tied:
        tensors.append(("output.weight", vocab, s.hidden))
    kind = gguf.GGMLQuantizationType[fmt]
    nbytes = FORMATS[fmt][1]
    for tname, rows, cols in tensors:
        if cols is None:
            w.add_tensor_info(tname, (rows,), np.dtype(np.float32), rows * 4)
        else:
            shape = (rows, cols // block * nbytes)  # bytes: the writer turns them into weights
            w.add_tensor_info(tname, shape, np.dtype(np.uint8), rows * shape[1], raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, rows, cols in tensors:
        w.write_tensor_data(np.ones(rows, np.float32) if cols is None else random_blocks(fmt, rows, cols, rng))
    w.close()
    return path


def _copy_tokenizer(reader, w) -> None:
    """Every tokenizer.* field of ``reader`` (SmolLM2's vocabulary, merges, special ids, chat template)."""
    from gguf import GGUFValueType

    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), kind)
