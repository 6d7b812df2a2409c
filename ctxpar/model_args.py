"""ctxpar's description of a model: what its config.json (or a GGUF file's metadata,
models/gguf_config.py) says, read into one typed record, as gpt-fast's ``ModelArgs``.

The models are built from it (models/llama.py, models/deepseek.py), the cost model
derives its shapes from it (costmodel/shapes.py), and the engine reads it as vLLM's
``hf_config``. Its fields carry Hugging Face's config.json names, so a model
built from a transformers config (the tests' references) reads the same
attributes. Reading it imports nothing of transformers: a config.json of the
Llama family (llama, mistral, qwen2, qwen3, and Qwen's MoE models) is read here; another model type's
(DeepSeek, Gemma), whose keys its transformers class fills in when config.json omits
them, is read by ``AutoConfig`` and then described here (``ModelArgs.of``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ctxpar.errors import CtxparError

# Rope types and the parameters each needs (transformers.modeling_rope_utils computes them).
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
# The rope types whose scaling refers to the context length the model was trained at.
_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")
# Families whose config.json is read here; another model type is read by AutoConfig.
READ_HERE = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# The Qwen families: a sliding window only where use_sliding_window says so.
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# Gemma 2 and 3 (text): their config.json is read by AutoConfig, whose classes default the soft-caps.
GEMMA = ("gemma2", "gemma3_text")
# The token ids a config.json of the family means where it states none (its transformers class's defaults).
_TOKEN_DEFAULTS = {"llama": (1, 2), "mistral": (1, 2)}
LAYER_TYPES = ("full_attention", "sliding_attention")
# A multimodal config's keys that hold for its text model (beside its text_config's).
_OUTER_KEYS = ("architectures", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
# Keys every config.json states: the model's shape.
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# DeepSeek's keys, read as config.json (or its transformers class) has them.
_MLA_MOE_KEYS = (
    "q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim rope_interleave num_nextn_predict_layers "
    "n_routed_experts n_shared_experts moe_intermediate_size num_experts_per_tok first_k_dense_replace "
    "moe_layer_freq n_group topk_group topk_method scoring_func norm_topk_prob routed_scaling_factor"
).split()
# Qwen-MoE's keys (Qwen2MoeConfig's, Qwen3MoeConfig's) beside DeepSeek's that it shares.
_QWEN_MOE_KEYS = ("shared_expert_intermediate_size", "decoder_sparse_step")


@dataclass(frozen=True)
class RopeScaling:
    """The rotary embedding: its base, and its scaling (type and factors) by the keys
    of config.json's ``rope_parameters`` (older: ``rope_scaling`` and ``rope_theta``)."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None
    attention_factor: float | None = None  # yarn, longrope: cos/sin scale
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None
    # The fraction of each head the rope turns, its first dims (Phi-4-mini: 0.75); None: the whole head.
    partial_rotary_factor: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise CtxparError(f"rope_type {self.rope_type!r} is unknown; known: {', '.join(ROPE_TYPES)}")
        missing = [k for k in ROPE_TYPES[self.rope_type] if getattr(self, k) is None]
        if missing:
            raise CtxparError(f"rope_type {self.rope_type!r} needs {', '.join(missing)} in rope_parameters")
        if not self.rope_theta > 0:
            raise CtxparError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.factor is not None and not self.factor >= 1.0:
            raise CtxparError(f"rope factor must be >= 1, got {self.factor}")
        if self.partial_rotary_factor is not None and not 0 < self.partial_rotary_factor < 1:
            raise CtxparError(
                f"partial_rotary_factor must be in (0, 1) (None: the whole head), got {self.partial_rotary_factor}"
            )

    @property
    def parameters(self) -> dict[str, Any]:
        """As transformers' config holds them (``rope_parameters``): the keys that are set."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class ModelArgs:
    """A decoder-only model's architecture; validated when built (CtxparError naming the field)."""

    model_type: str  # config.json's model_type: "llama", "qwen2", "deepseek_v3", ... ("" where none is stated)
    architectures: tuple[str, ...]  # the model class names (models/registry.py picks by the first)
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # MLA: the roped part's (qk_rope_head_dim), as transformers' DeepSeek configs set it
    max_position_embeddings: int | None  # the context length, None where the config states none
    rms_norm_eps: float
    rope: RopeScaling
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False  # biases on the q, k, v and o projections (Llama's, DeepSeek's key)
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2)
    qk_norm: bool = False  # an RMSNorm on each query and key head before rope (Qwen3, Gemma 3)
    mlp_bias: bool = False
    sliding_window: int | None = None  # keys a sliding-attention layer's query sees
    layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES (all full attention when empty)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # MLA (DeepSeek-V2/V3): a compressed KV latent of kv_lora_rank values and a roped key.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool | None = None
    num_nextn_predict_layers: int | None = None
    # MoE (DeepSeek): routed experts from layer first_k_dense_replace on, every moe_layer_freq-th.
    # None where config.json leaves the key to the model's default (models/deepseek.py).
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    moe_intermediate_size: int | None = None
    num_experts_per_tok: int | None = None
    first_k_dense_replace: int | None = None
    moe_layer_freq: int | None = None
    n_group: int | None = None
    topk_group: int | None = None
    topk_method: str | None = None
    scoring_func: str | None = None
    norm_topk_prob: bool | None = None
    routed_scaling_factor: float | None = None
    # MoE (Qwen2-MoE, Qwen3-MoE): num_experts routed experts in every decoder_sparse_step-th layer
    # but mlp_only_layers (those have the dense MLP), and Qwen2-MoE's gated shared expert.
    num_experts: int | None = None
    shared_expert_intermediate_size: int | None = None
    decoder_sparse_step: int | None = None
    mlp_only_layers: tuple[int, ...] = ()
    # Gemma: the attention's scale is query_pre_attn_scalar**-0.5 (None: head_dim**-0.5); logits
    # pass through cap * tanh(logit / cap), the attention's and the final ones; Gemma 3's sliding
    # layers turn by a rope of their own (None: ``rope``, every layer's).
    query_pre_attn_scalar: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_rope: RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in _SHAPE_KEYS + ("num_key_value_heads", "head_dim"):
            _positive(self, name)
        turned = int(self.head_dim * (self.rope.partial_rotary_factor or 1.0))  # transformers' rope tables' width
        if turned < 2 or turned % 2:
            raise CtxparError(
                f"partial_rotary_factor {self.rope.partial_rotary_factor} of head_dim {self.head_dim} turns "
                f"{turned} dims of each head; a rope turns pairs of them"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise CtxparError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not (isinstance(self.rms_norm_eps, float) and self.rms_norm_eps > 0):
            raise CtxparError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if self.max_position_embeddings is not None:
            _positive(self, "max_position_embeddings")
        if self.sliding_window is not None:
            _positive(self, "sliding_window")
        if self.layer_types and (
            len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES)
        ):
            raise CtxparError(
                f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the "
                f"{self.num_hidden_layers} layers, got {list(self.layer_types)}"
            )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise CtxparError("layer_types has sliding_attention layers but sliding_window is not set")
        mla = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if any(getattr(self, k) is not None for k in mla):
            for name in mla:
                _positive(self, name)
        for experts in ("n_routed_experts", "num_experts"):
            count = getattr(self, experts)
            if not count:
                continue
            for name in ("moe_intermediate_size", "num_experts_per_tok"):
                _positive(self, name)
            if self.num_experts_per_tok is not None and self.num_experts_per_tok > count:
                raise CtxparError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds {experts} ({count})")
        if self.decoder_sparse_step is not None:
            _positive(self, "decoder_sparse_step")
        if self.query_pre_attn_scalar is not None:
            _positive(self, "query_pre_attn_scalar")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, float) and value > 0):
                raise CtxparError(f"{name} must be a positive number, got {value!r}")

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """The rope as transformers' config holds it, which its rope initialisers read
        (layers/rotary.py hands them this description)."""
        return self.rope.parameters

    def standardize_rope_params(self) -> None:
        """Called by transformers' rope initialisers on the config they get: ``rope_parameters``
        is in their standard form already."""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def mla_dims(self) -> tuple[int, int, int, int]:
        """An MLA model's (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)."""
        dims = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if not all(isinstance(d, int) for d in dims):
            raise CtxparError(f"the {self.model_type} model is not an MLA model")
        return dims  # type: ignore[return-value]  # checked above

    def is_moe_layer(self, layer: int) -> bool:
        """Whether a Qwen-MoE layer's feed-forward is its experts (transformers' rule)."""
        step = self.decoder_sparse_step or 1
        return bool(self.num_experts) and layer not in self.mlp_only_layers and (layer + 1) % step == 0

    @property
    def sliding_layers(self) -> list[int]:
        """The layers whose attention is windowed (``sliding_window`` keys)."""
        return [i for i, t in enumerate(self.layer_types) if t == "sliding_attention"]

    @classmethod
    def of(cls, config: Any) -> ModelArgs:
        """``config`` as a ModelArgs: itself, or a transformers config described."""
        return config if isinstance(config, ModelArgs) else from_config_json(config.to_dict())

    def to_config_json(self) -> dict[str, Any]:
        """A config.json that this reads back as itself and transformers reads as its own
        class of ``model_type`` (a converted GGUF's, models/gguf.py)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("rope", "sliding_rope", "qkv_bias", "qk_norm", "layer_types", "mlp_only_layers") and (
                value is not None
            ):
                out[f.name] = list(value) if isinstance(value, tuple) else value
        out["rope_parameters"] = self.rope_parameters
        # Stated where None: the families' classes default them (Mistral to a window, Llama to ids 1 and 2).
        out["sliding_window"] = self.sliding_window
        out["bos_token_id"], out["pad_token_id"] = self.bos_token_id, self.pad_token_id
        out["eos_token_id"] = list(self.eos_token_id) if self.eos_token_id else None
        if self.model_type in _QWEN:
            out["use_sliding_window"] = self.sliding_window is not None
            out["layer_types"] = list(self.layer_types) or None
        if self.mlp_only_layers:
            out["mlp_only_layers"] = list(self.mlp_only_layers)
        if self.model_type in GEMMA:  # stated where None: Gemma 2's class defaults the soft-caps
            out["layer_types"] = list(self.layer_types) or None
            out["hidden_activation"] = self.hidden_act
            out["attn_logit_softcapping"] = self.attn_logit_softcapping
            out["final_logit_softcapping"] = self.final_logit_softcapping
        if self.sliding_rope is not None:  # per layer type, as Gemma 3's config holds it
            out["rope_parameters"] = {
                "full_attention": self.rope_parameters,
                "sliding_attention": self.sliding_rope.parameters,
            }
        if self.model_type == "qwen2_moe":  # its config states it (its class defaults it to True)
            out["qkv_bias"] = self.qkv_bias
        if self.is_mla:  # stated where None: DeepSeek's classes default a low-rank query (V2-Lite has none)
            out["q_lora_rank"] = self.q_lora_rank
        if self.rope.original_max_position_embeddings is not None:  # Phi3Config's own default (4096) would win
            out["original_max_position_embeddings"] = self.rope.original_max_position_embeddings
        return out


def _positive(args: Any, name: str) -> None:
    _positive_value(name, getattr(args, name))


def _positive_value(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CtxparError(f"{name} must be a positive integer, got {value!r}")


def _given(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    """cfg[key], or ``default`` where the key is absent or null."""
    value = cfg.get(key)
    return default if value is None else value


def _rope(cfg: Mapping[str, Any], max_len: int | None) -> RopeScaling:
    """config.json's rope: ``rope_scaling`` (transformers 4's name, which transformers
    reads first) or ``rope_parameters``, ``rope_theta`` beside it where the dict has none."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise CtxparError(f"rope parameters per layer type ({', '.join(params)}) are not supported")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):  # one form for "the whole head": None
        params["partial_rotary_factor"] = _float(partial)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = cfg.get("rope_theta", RopeScaling.rope_theta)
    if rope_type in _ORIGINAL_LENGTH:
        # A top-level original length wins, as transformers' standardisation has it (Phi-3's).
        original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or max_len
    known = {f.name for f in dataclasses.fields(RopeScaling)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise CtxparError(f"rope parameters {unknown} are not ones ctxpar reads ({', '.join(sorted(known))})")
    for key in ("short_factor", "long_factor"):
        if params.get(key) is not None:
            params[key] = tuple(float(x) for x in params[key])
    try:
        return RopeScaling(rope_type=rope_type, rope_theta=float(theta), **params)
    except (TypeError, ValueError) as e:
        raise CtxparError(f"bad rope parameters {params}: {e}") from None


def _ropes(cfg: Mapping[str, Any], max_len: int | None) -> tuple[RopeScaling, RopeScaling | None]:
    """The rope of every layer, and the sliding layers' own where the config gives one rope per
    layer type (Gemma 3's ``rope_parameters``: full_attention's and sliding_attention's)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not (isinstance(params, Mapping) and params and set(params) <= set(LAYER_TYPES)):
        return _rope(cfg, max_len), None
    each = [{**cfg, "rope_scaling": None, "rope_parameters": params.get(kind)} for kind in LAYER_TYPES]
    return _rope(each[0], max_len), _rope(each[1], max_len)


def _float(value: Any) -> Any:
    """A config's number as a float (JSON may spell it as an integer), anything else as it is."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _layer_types(cfg: Mapping[str, Any], model_type: str, layers: int, window: int | None) -> tuple[str, ...]:
    """Each layer's attention. Qwen: windowed from layer max_window_layers on, where
    use_sliding_window; Mistral: every layer where sliding_window is set."""
    stated = cfg.get("layer_types")
    if stated is not None:
        if not isinstance(stated, list) or len(stated) != layers or not set(stated) <= set(LAYER_TYPES):
            raise CtxparError(f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the {layers} layers")
        return tuple(stated)
    if window is None:
        return ()
    first = _given(cfg, "max_window_layers", 0) if model_type in _QWEN else 0
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))


def text_model_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal model's config (``text_config`` beside a vision config: Gemma 3 4B-27B) as its
    text model's, which ctxpar runs, the outer config's class names, stop ids and tying kept;
    any other config as it is."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        return cfg
    return {**text, **{k: cfg[k] for k in _OUTER_KEYS if cfg.get(k) is not None}}


def from_config_json(cfg: Mapping[str, Any]) -> ModelArgs:
    """A config.json's object as a ModelArgs; CtxparError naming what is missing or wrong.
    The shape keys are required (hidden_size, num_hidden_layers, num_attention_heads,
    intermediate_size, vocab_size); the others take transformers' defaults for the family.
    A multimodal model's (``text_config`` beside a vision config: Gemma 3 4B-27B) is its
    text model's, which ctxpar runs (models/registry.py names the architectures)."""
    if not isinstance(cfg, Mapping):
        raise CtxparError(f"a model config is a JSON object, got {type(cfg).__name__}")
    cfg = text_model_config(cfg)
    model_type = cfg.get("model_type") or ""
    for key in _SHAPE_KEYS:
        if cfg.get(key) is None:
            raise CtxparError(f"the model config lacks {key!r}")
        _positive_value(key, cfg[key])
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    max_len = cfg.get("max_position_embeddings")
    head_dim: Any
    if cfg.get("kv_lora_rank") is not None:  # MLA: the rope's part of a head (transformers' head_dim)
        head_dim = cfg.get("qk_rope_head_dim")
    elif cfg.get("head_dim") is not None:
        head_dim = cfg["head_dim"]
    elif hidden % heads:
        raise CtxparError(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
    else:
        head_dim = hidden // heads
    window: int | None = cfg.get("sliding_window")
    if model_type in _QWEN and not cfg.get("use_sliding_window", False):
        window = None
    if model_type == "mistral" and "sliding_window" not in cfg:
        window = 4096  # MistralConfig's default: a config.json without the key means Mistral v0.1's window
    layer_types = _layer_types(cfg, model_type, layers, window)
    if "sliding_attention" not in layer_types:  # one form for "every layer attends in full"
        window, layer_types = None, ()
    eps = cfg.get("rms_norm_eps", 1e-6)
    bos, eos = _TOKEN_DEFAULTS.get(model_type, (None, None))
    rope, sliding_rope = _ropes(cfg, max_len)
    return ModelArgs(
        model_type=model_type,
        architectures=tuple(cfg.get("architectures") or ()),
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_given(cfg, "num_key_value_heads", heads),
        head_dim=head_dim,
        max_position_embeddings=max_len,
        rms_norm_eps=float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else eps,
        rope=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
        attention_bias=bool(cfg.get("attention_bias", False)),
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True))),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=window,
        layer_types=layer_types,
        bos_token_id=cfg.get("bos_token_id", bos),
        eos_token_id=_eos(cfg.get("eos_token_id", eos)),
        pad_token_id=cfg.get("pad_token_id"),
        **{k: cfg.get(k) for k in (*_MLA_MOE_KEYS, *_QWEN_MOE_KEYS)},
        # transformers 5 saves Qwen3-MoE's as num_local_experts, the hub's config.json files as num_experts
        num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        attn_logit_softcapping=_float(cfg.get("attn_logit_softcapping")),
        final_logit_softcapping=_float(cfg.get("final_logit_softcapping")),
        sliding_rope=sliding_rope,
    )
