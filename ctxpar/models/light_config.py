"""Light copies of transformers' config classes for the Llama family (llama, qwen2,
qwen3): reading a model's config through them imports none of transformers' model
modules (``transformers.models.llama.configuration_llama`` pulls in
``torch.distributed.tensor`` and more, about a second of a load). The loader
(models/loader.py) reads other configs, and these under another transformers
release, with AutoConfig."""

from __future__ import annotations

import functools
from typing import Any

# The transformers releases whose config classes _light_config_classes copies (checked
# field by field by tests/models/test_light_config.py): under another, AutoConfig reads
# every config, slower but right, and that test fails until the copies are checked again.
LIGHT_CONFIGS_OF = ("5.25.",)


def light_config_class(model_type: Any) -> Any:
    """ctxpar's copy of transformers' config class for ``model_type`` (llama, qwen2,
    qwen3), or None for another type, or another transformers release (read by AutoConfig)."""
    if not isinstance(model_type, str) or not _copies_current():
        return None
    return _light_config_classes().get(model_type)


@functools.cache
def _copies_current() -> bool:
    import transformers

    return transformers.__version__.startswith(LIGHT_CONFIGS_OF)


@functools.cache
def _light_config_classes() -> dict[str, Any]:
    """{model_type: config class}: transformers 5.25's LlamaConfig, Qwen2Config and
    Qwen3Config (transformers/models/<type>/configuration_<type>.py), their fields,
    defaults, ``__post_init__`` and checks copied onto transformers' ``PreTrainedConfig``
    (transformers.configuration_utils, which imports no model's module), which
    does the rest as for theirs: the rope parameters' standardisation, dtype,
    labels, extra keys. Named as transformers' classes: AutoTokenizer looks a
    config's class up by its name. Left out: the tensor/pipeline-parallel plans
    (transformers' modelling only) and initializer_range's range check (whose
    module imports what this avoids). Built on first use, so importing the loader
    does not import transformers."""
    from huggingface_hub.dataclasses import strict
    from transformers import PreTrainedConfig

    def reduce(self: Any) -> tuple[Any, ...]:  # pickled by model_type: the classes are not module attributes
        return _unpickle_light_config, (self.model_type, self.__dict__)

    @strict
    class LlamaConfig(PreTrainedConfig):
        model_type = "llama"
        __reduce__ = reduce

        vocab_size: int = 32000
        hidden_size: int = 4096
        intermediate_size: int = 11008
        num_hidden_layers: int = 32
        num_attention_heads: int = 32
        num_key_value_heads: int | None = None
        hidden_act: str = "silu"
        max_position_embeddings: int = 2048
        initializer_range: float = 0.02
        rms_norm_eps: float = 1e-6
        use_cache: bool = True
        pad_token_id: int | None = None
        bos_token_id: int | None = 1
        eos_token_id: int | list[int] | None = 2
        pretraining_tp: int | None = 1
        tie_word_embeddings: bool = False
        rope_parameters: dict | None = None
        attention_bias: bool = False
        attention_dropout: int | float | None = 0.0
        mlp_bias: bool = False
        head_dim: int | None = None

        def __post_init__(self, **kwargs: Any) -> None:
            if self.head_dim is None:
                self.head_dim = self.hidden_size // self.num_attention_heads
            if self.num_key_value_heads is None:
                self.num_key_value_heads = self.num_attention_heads
            super().__post_init__(**kwargs)

        def validate_architecture(self) -> None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"The hidden size ({self.hidden_size}) is not a multiple of the number of attention "
                    f"heads ({self.num_attention_heads})."
                )

    def qwen_post_init(self: Any) -> None:
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention"
                if self.sliding_window is not None and i >= self.max_window_layers
                else "full_attention"
                for i in range(self.num_hidden_layers)
            ]

    @strict
    class Qwen2Config(PreTrainedConfig):
        model_type = "qwen2"
        __reduce__ = reduce

        vocab_size: int = 151936
        hidden_size: int = 4096
        intermediate_size: int = 22016
        num_hidden_layers: int = 32
        num_attention_heads: int = 32
        num_key_value_heads: int | None = 32
        hidden_act: str = "silu"
        max_position_embeddings: int = 32768
        initializer_range: float = 0.02
        rms_norm_eps: float = 1e-6
        use_cache: bool = True
        tie_word_embeddings: bool = False
        rope_parameters: dict | None = None
        use_sliding_window: bool = False
        sliding_window: int | None = 4096
        max_window_layers: int = 28
        layer_types: list[str] | None = None
        attention_dropout: float | int = 0.0
        pad_token_id: int | None = None
        bos_token_id: int | None = None
        eos_token_id: int | list[int] | None = None

        def __post_init__(self, **kwargs: Any) -> None:
            qwen_post_init(self)
            super().__post_init__(**kwargs)

    @strict
    class Qwen3Config(PreTrainedConfig):
        model_type = "qwen3"
        __reduce__ = reduce

        vocab_size: int = 151936
        hidden_size: int = 4096
        intermediate_size: int = 22016
        num_hidden_layers: int = 32
        num_attention_heads: int = 32
        num_key_value_heads: int | None = 32
        head_dim: int = 128
        hidden_act: str = "silu"
        max_position_embeddings: int = 32768
        initializer_range: float = 0.02
        rms_norm_eps: float = 1e-6
        use_cache: bool = True
        tie_word_embeddings: bool = False
        rope_parameters: dict | None = None
        attention_bias: bool = False
        use_sliding_window: bool = False
        sliding_window: int | None = 4096
        max_window_layers: int = 28
        layer_types: list[str] | None = None
        attention_dropout: float | int = 0.0
        pad_token_id: int | None = None
        bos_token_id: int | None = None
        eos_token_id: int | list[int] | None = None

        def __post_init__(self, **kwargs: Any) -> None:
            qwen_post_init(self)
            super().__post_init__(**kwargs)

    classes = (LlamaConfig, Qwen2Config, Qwen3Config)
    for c in classes:
        c.__qualname__ = c.__name__
    return {c.model_type: c for c in classes}


def _unpickle_light_config(model_type: str, state: dict[str, Any]) -> Any:
    cls = _light_config_classes()[model_type]
    config = cls.__new__(cls)
    config.__dict__.update(state)
    return config
