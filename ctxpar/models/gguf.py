"""GGUF files (llama.cpp) -> a cached Hugging Face model directory.

Reading and dequantising a GGUF takes seconds, and rebuilding its tokenizer
through transformers 5-15 more, so a file is converted once into
``<cache>/gguf/<stem>-<key>/`` (config.json, model.safetensors with HF tensor
names in fp32, the tokenizer with its chat template) and later loads read that
directory like any HF checkpoint. ``<cache>`` is $CTXPAR_CACHE or
~/.cache/ctxpar; the key hashes the file's absolute path, size and mtime.
The directory appears atomically (built under a temporary name, then
renamed), so ranks that convert concurrently never see half a cache. Its name
is no proof of what it holds: it is served only if it, and every file in it,
is this user's and writable by nobody else (ctxpar.paths), else the file is
converted afresh into a private temporary directory.

With ``quantization="gguf"`` the projections and the embedding are read
from the GGUF itself instead, as blocks (``quantized_tensors``): the kernel's
layout of each tensor (layers/quant_linear.py), built in about a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ctxpar.errors import CtxparError
from ctxpar.layers.quant_blocks import FORMATS, decode
from ctxpar.layers.quant_linear import QuantWeight
from ctxpar.paths import cache_dir, cache_root, make_private, tree_refusal, warn_refused

FORMAT_VERSION = 1  # bump when the cached layout changes
MARKER = "ctxpar_gguf.json"

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def is_gguf(path: Path) -> bool:
    """True if the file starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def cache_dir_for(path: Path) -> Path:
    """Where the converted form of the GGUF file `path` lives (or will)."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{FORMAT_VERSION}"
    return cache_root() / "gguf" / f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def gguf_to_hf_dir(path: Path) -> tuple[Path, bool]:
    """Return (HF directory holding the converted GGUF, is_temporary).

    Uses the cache when it holds this file and may be trusted; converts and
    fills it otherwise. If the cache cannot be used (not writable, or refused:
    a warning says why), or its directory for this file is refused, converts
    into a private temporary directory that the caller deletes after loading
    (is_temporary=True).
    """
    root = cache_dir("gguf", cost="GGUF files are converted again on every load")
    if root is None:
        return _convert_to_temporary(path), True
    target = root / cache_dir_for(path).name
    try:
        why = tree_refusal(target)
    except FileNotFoundError:
        why = None
    if why is not None:
        warn_refused(f"the converted model {target}", why)
        return _convert_to_temporary(path), True
    if (target / MARKER).exists():
        return target, False
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        convert_gguf(path, tmp)
        make_private(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race, or a stale partial dir is in the way
            if not (target / MARKER).exists():
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, False


def _convert_to_temporary(path: Path) -> Path:
    """The GGUF file converted into a fresh private temporary directory (the caller deletes it)."""
    tmp = Path(tempfile.mkdtemp(prefix="ctxpar-gguf-"))
    try:
        convert_gguf(path, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def convert_gguf(path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer of GGUF `path` into out_dir."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    try:
        reader = GGUFReader(path)
    except Exception as e:
        raise CtxparError(
            f"cannot read GGUF file {path}: {e}. The file is corrupt or not GGUF; download it again"
        ) from e
    config = config_from_gguf(reader, path)
    tensors = dict(hf_tensors(reader, config, path))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config.save_pretrained(out_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise CtxparError(f"cannot build the tokenizer of GGUF file {path}: {e}") from e
    tokenizer.save_pretrained(out_dir)
    (out_dir / MARKER).write_text(json.dumps({"source": str(path.resolve()), "version": FORMAT_VERSION}))


def _metadata(reader) -> dict:
    """Scalar and string fields of the GGUF header (large arrays such as the vocabulary are skipped)."""
    meta = {}
    for key, field in reader.fields.items():
        if len(field.data) <= 1:
            meta[key] = field.contents()
    return meta


def config_from_gguf(reader, path: Path):
    """A transformers LlamaConfig built from the GGUF metadata."""
    from transformers import LlamaConfig

    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CtxparError(f"GGUF file {path} has architecture {arch!r}; ctxpar reads only 'llama' GGUF files")
    names = {t.name for t in reader.tensors}
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in names:
        raise CtxparError(f"GGUF file {path} uses rope scaling, which ctxpar reads only from HF directories")

    def get(key: str):
        if f"llama.{key}" not in meta:
            raise CtxparError(f"GGUF file {path} lacks metadata llama.{key}")
        return meta[f"llama.{key}"]

    heads, hidden = get("attention.head_count"), get("embedding_length")
    vocab = meta.get("llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", heads),
        head_dim=meta.get("llama.attention.key_length") or meta.get("llama.rope.dimension_count") or hidden // heads,
        max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def hf_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> Hugging Face name (None if unknown)."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of a Q/K weight (rows) or bias: (n_head*hd, ...) -> HF layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader, config, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantised fp32 tensors of the GGUF under HF names, Q and K un-permuted."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise CtxparError(f"GGUF file {path} has tensor {t.name!r} that ctxpar does not know")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if ".self_attn.q_proj." in name:
            w = unpermute(w, config.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            w = unpermute(w, config.num_key_value_heads)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, order="C"))


def quantized_tensors(path: Path, config) -> dict[str, QuantWeight]:
    """The GGUF's block-quantized 2-D tensors (formats of layers/quant_blocks.py)
    under HF names, in the kernel's layout, Q and K rows un-permuted (a row
    permutation moves whole rows of blocks). Other tensors (norms; F16/F32
    weights) are not here: they load dequantized from the converted directory."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    out: dict[str, QuantWeight] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in FORMATS or len(t.shape) != 2:
            continue
        name = hf_name(t.name)
        if name is None:
            raise CtxparError(f"GGUF file {path} has tensor {t.name!r} that ctxpar does not know")
        cols, rows = int(t.shape[0]), int(t.shape[1])  # innermost first
        raw = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1)  # (rows, blocks * bytes)
        if ".self_attn.q_proj." in name:
            raw = unpermute(raw, config.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            raw = unpermute(raw, config.num_key_value_heads)
        out[name] = QuantWeight.from_decoded(decode(raw, kind, cols))
    return out
