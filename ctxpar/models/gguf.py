"""GGUF files (llama.cpp): the model read from a memory map of the file.

The weights are read where they lie: ``gguf_weights`` maps the file
(models/gguf_file.py: read-only, the page cache's pages) and yields each tensor
under its Hugging Face name, a projection kept quantized as its blocks in
the map, which the model places (layers/quant_linear.py's ``join``): Q4_0,
Q4_1 and Q8_0 blocks stay in the map and the kernels read them there, so
every process that maps the file (PCP ranks on one host) reads the same
pages and a load copies nothing; Q and K, whose rows llama.cpp permutes for
its rope in a ``llama`` file, are copied out un-permuted (one strided copy into huge pages); the
other formats are decoded once, the rest dequantized. The file is read ahead,
in order (models/gguf_file.py's ``read_ahead``), so a load of a file not in
the page cache reads the disk at its speed. Nothing the size of the weights is
written anywhere.

What is slow to rebuild is the tokenizer (transformers takes 5-15 s to build
it from the GGUF's vocabulary), so that, with the config, is cached once in
``<cache>/gguf/<stem>-<key>/`` (config.json, the tokenizer with its chat
template: a few MB). ``<cache>`` is $CTXPAR_CACHE or ~/.cache/ctxpar; the key
hashes the file's absolute path, size and mtime. The directory appears
atomically (built under a temporary name, then renamed), so ranks that
convert concurrently never see half a cache. Its name is no proof of what it
holds: it is served only if it, and every file in it, is this user's and
writable by nobody else (ctxpar.paths), else it is built afresh into a private
temporary directory. Benchmarks that hand the model to another program
(vLLM, transformers) ask for the weights too (``with_weights``): a full fp32
safetensors checkpoint in a directory of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ctxpar import kernels
from ctxpar.errors import CtxparError
from ctxpar.kernels.huge_pages import HugeArena
from ctxpar.layers.quant_blocks import FORMATS
from ctxpar.layers.quant_linear import BF16, MappedBlocks
from ctxpar.model_args import ModelArgs
from ctxpar.models import gguf_tokenizer
from ctxpar.models.gguf_config import FUSED_GATE_UP, GEMMA, PERMUTED_QK, config_from_gguf
from ctxpar.models.gguf_file import GGUFFile, GGUFTensor
from ctxpar.models.gguf_mla import joined_kv_b
from ctxpar.paths import cache_dir, cache_root, make_private, tree_refusal, warn_refused

FORMAT_VERSION = 5  # bump when the cached layout changes
MARKER = "ctxpar_gguf.json"

# Architectures whose GGUF config transformers does not read (its tokenizer it does).
_TOKENIZER_ONLY = ("deepseek2",)
# Read into the model's description (models/gguf_config.py), not a weight.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_qkv": "self_attn.qkv_proj",  # fused (Phi-3)
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    # MLA (deepseek2): the query's low-rank step (or attn_q), the latent and its norm, the key and
    # value up-projections (split in two by the converter: models/gguf_mla.py joins them).
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "exp_probs_b": "mlp.gate.e_score_correction",  # V3's router bias (.bias: e_score_correction_bias)
}
# DeepSeek's checkpoint names where they differ from Qwen-MoE's.
_MLA_RENAMES = (
    (".mlp.shared_expert.", ".mlp.shared_experts."),
    (".e_score_correction.bias", ".e_score_correction_bias"),
)
# Gemma's norms on each side of attention and MLP (its ffn_norm the one before the MLP).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# An MoE layer's experts, one 3-D tensor (experts, rows, columns) for each projection.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def is_gguf(path: Path) -> bool:
    """True if the file starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def cache_dir_for(path: Path, with_weights: bool = False) -> Path:
    """Where the converted form of the GGUF file `path` lives (or will)."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{FORMAT_VERSION}"
    suffix = "-weights" if with_weights else ""
    return cache_root() / "gguf" / f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}{suffix}"


def gguf_to_hf_dir(path: Path, with_weights: bool = False) -> tuple[Path, bool]:
    """Return (HF directory of the GGUF's config and tokenizer, is_temporary);
    ``with_weights`` adds model.safetensors, the weights dequantized to fp32.

    Uses the cache when it holds this file and may be trusted; converts and
    fills it otherwise. If the cache cannot be used (not writable, or refused:
    a warning says why), or its directory for this file is refused, converts
    into a private temporary directory that the caller deletes after loading
    (is_temporary=True).
    """
    root = cache_dir("gguf", cost="GGUF files are converted again on every load")
    if root is None:
        return _convert_to_temporary(path, with_weights), True
    target = root / cache_dir_for(path, with_weights).name
    try:
        why = tree_refusal(target)
    except FileNotFoundError:
        why = None
    if why is not None:
        warn_refused(f"the converted model {target}", why)
        return _convert_to_temporary(path, with_weights), True
    if (target / MARKER).exists():
        return target, False
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        convert_gguf(path, tmp, with_weights)
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


def _convert_to_temporary(path: Path, with_weights: bool) -> Path:
    """The GGUF file converted into a fresh private temporary directory (the caller deletes it)."""
    tmp = Path(tempfile.mkdtemp(prefix="ctxpar-gguf-"))
    try:
        convert_gguf(path, tmp, with_weights)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def convert_gguf(path: Path, out_dir: Path, with_weights: bool = False) -> None:
    """Write config.json and the tokenizer of GGUF `path` into out_dir, and with
    ``with_weights`` model.safetensors (fp32, Hugging Face names)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    reader = open_gguf(path)
    config = config_from_gguf(reader, path)
    if with_weights:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        for name, t in gguf_weights(reader, config, path, keep_quantized=False):
            if not isinstance(t, torch.Tensor):  # keep_quantized=False dequantizes every weight
                raise TypeError(f"{name}: expected a float tensor, got {type(t).__name__}")
            tensors[name] = t
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        del tensors
    (out_dir / "config.json").write_text(json.dumps(config.to_config_json(), indent=2))
    try:
        # AutoTokenizer reads the file's config first, which transformers does not for deepseek2;
        # the tokenizer itself it builds from the file's vocabulary whatever the architecture.
        auto = reader.metadata.get("general.architecture") not in _TOKENIZER_ONLY
        tokenizer = (AutoTokenizer if auto else PreTrainedTokenizerFast).from_pretrained(
            str(path.parent), gguf_file=path.name
        )
    except Exception as e:
        raise CtxparError(f"cannot build the tokenizer of GGUF file {path}: {e}") from e
    tokenizer.save_pretrained(out_dir)
    gguf_tokenizer.snapshot(out_dir)  # what later starts load without transformers
    (out_dir / MARKER).write_text(json.dumps({"source": str(path.resolve()), "version": FORMAT_VERSION}))


def open_gguf(path: Path) -> GGUFFile:
    """The file's header, its tensors views of a read-only memory map (models/gguf_file.py)."""
    try:
        return GGUFFile(path)
    except Exception as e:
        raise CtxparError(
            f"cannot read GGUF file {path}: {e}. The file is corrupt or not GGUF; download it again"
        ) from e


def hf_name(gguf_name: str, gemma: bool = False) -> str | None:
    """llama.cpp tensor name -> Hugging Face name (None if unknown); ``gemma``: a Gemma file's."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    parts, names = base.split(".", 2), _GEMMA_LAYER_NAMES if gemma else _LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{kind}"
    return None


def expert_names(gguf_name: str) -> str | None:
    """llama.cpp's name of a layer's experts -> the Hugging Face name of each, a template of
    the expert's index (None for another tensor)."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES:
        return f"model.layers.{parts[1]}.mlp.experts.{{}}.{_EXPERT_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermuted_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rope permutation of a Q/K weight's rows (or a bias) undone, as a view:
    (n_head, 2, hd / 2, ...) whose first three axes, flattened in order, are the HF rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of a Q/K weight (rows) or bias: (n_head*hd, ...) -> HF layout."""
    return unpermuted_rows(w, n_head).reshape(w.shape)


def gguf_weights(
    reader: GGUFFile, config: ModelArgs, path: Path, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | MappedBlocks]]:
    """``_tensors``, a DeepSeek file's (MLA) under its checkpoint's names, its key and value
    up-projections joined as the checkpoint has them."""
    weights = _tensors(reader, config, path, keep_quantized)
    if not config.is_mla:
        return weights
    return joined_kv_b((_renamed(name), w) for name, w in weights)


def _renamed(name: str) -> str:
    for old, new in _MLA_RENAMES:
        name = name.replace(old, new)
    return name


def _tensors(
    reader: GGUFFile, config: ModelArgs, path: Path, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | MappedBlocks]]:
    """Every tensor of the GGUF under its HF name, Q and K rows un-permuted (a ``llama``
    file's: models/gguf_config.py's PERMUTED_QK), the rope_freqs left out, read
    from the file's memory map one at a time. ``keep_quantized``: the 2-D tensors
    in a block format of layers/quant_blocks.py, or BF16 where ctxpar's kernels run (their bf16
    panels multiply the file's bits), as their blocks in the map
    (``MappedBlocks``, a row permutation a view that moves whole rows of blocks),
    to be placed by the model's ``join`` (in the map, or copied onto huge pages:
    kernels/huge_pages.py's ``HugeArena``); otherwise, and for the rest (norms;
    F16/F32 weights), float32 tensors."""
    from gguf.quants import dequantize

    arena = HugeArena()
    permuted = reader.metadata.get("general.architecture") in PERMUTED_QK
    fused_gate_up = reader.metadata.get("general.architecture") in FUSED_GATE_UP
    gemma = reader.metadata.get("general.architecture") in GEMMA
    heads = {".self_attn.q_proj.": config.num_attention_heads, ".self_attn.k_proj.": config.num_key_value_heads}
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        if keep_quantized:
            # Mapped now, in order: faults on the map (advised huge) read the file in 2 MB
            # folios, which the map then takes as huge pages; read_ahead's small reads would
            # fill the page cache with small ones first.
            reader.populate(t)
        else:
            reader.read_ahead(t)
        experts = expert_names(t.name)
        if experts is not None:
            yield from _each_expert(reader, t, experts, keep_quantized, arena)
            continue
        name = hf_name(t.name, gemma)
        if name is None:
            raise CtxparError(f"GGUF file {path} has tensor {t.name!r} that ctxpar does not know")
        if fused_gate_up:
            name = name.replace(".mlp.up_proj.", ".mlp.gate_up_proj.")
        kind = t.kind.name
        n_head = next((n for key, n in heads.items() if key in name), None) if permuted else None
        if keep_quantized and (kind in FORMATS or (kind == BF16 and kernels.available())) and len(t.shape) == 2:
            raw = t.data if n_head is None else unpermuted_rows(t.data, n_head)
            yield name, MappedBlocks(raw, kind, int(t.shape[0]), arena.empty, partial(reader.release, t))
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        w = np.asarray(dequantize(t.data, t.kind), dtype=np.float32).reshape(shape)
        if n_head is not None:
            w = unpermute(w, n_head)
        if gemma and name.endswith("norm.weight"):  # the file's 1 + w: the checkpoint's w (the model adds 1)
            w = w - np.float32(1.0)
        copy = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
        reader.release(t)
        yield name, copy


def _each_expert(
    reader: GGUFFile, t: GGUFTensor, names: str, keep_quantized: bool, arena: HugeArena
) -> Iterator[tuple[str, torch.Tensor | MappedBlocks]]:
    """A 3-D expert tensor as each expert's 2-D weight, under ``names.format(expert)``: with
    ``keep_quantized`` its rows of blocks in the map (contiguous: placed where they lie), or of
    BF16 where the kernels run (the file's bits, as a dense BF16 weight's), else float32 tensors."""
    from gguf.quants import dequantize

    count, kind = int(t.shape[2]), t.kind.name
    rows = t.data.shape[0] // count  # t.data: (experts * rows, bytes a row)
    if keep_quantized and (kind in FORMATS or (kind == BF16 and kernels.available())):
        for e in range(count):
            blocks = t.data[e * rows : (e + 1) * rows]
            yield names.format(e), MappedBlocks(blocks, kind, int(t.shape[0]), arena.empty, partial(reader.release, t))
        return
    shape = tuple(int(d) for d in reversed(t.shape))  # (experts, rows, columns)
    w = np.asarray(dequantize(t.data, t.kind), dtype=np.float32).reshape(shape)
    for e in range(count):
        yield names.format(e), torch.from_numpy(np.array(w[e], dtype=np.float32, order="C"))
    reader.release(t)
