"""Built-in model shapes: the fields of each model's published config.json that
the cost model reads (values copied from the Hugging Face Hub repositories named
in the comments; the other fields do not change FLOPs, bytes or parameters)."""

from __future__ import annotations

from typing import Any

BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.2-1B/config.json: 1.24B parameters
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-1.7B/config.json: 1.7B parameters, 1.4B without the embedding (head_dim 128 != hidden / heads)
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # meta-llama/Meta-Llama-3-8B/config.json: 8.03B parameters
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-70B/config.json: 70.6B parameters
    "llama-3-70b": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    # meta-llama/Llama-3.1-405B/config.json: 405.9B parameters (the model of Meta's CP paper)
    "llama-3-405b": {
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-32B/config.json: 32.8B parameters (head_dim 128 != hidden / heads)
    "qwen3-32b": {
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # deepseek-ai/DeepSeek-V3/config.json: 671B parameters, 37B active (MLA, 256 routed experts;
    # the multi-token-prediction layer, 14B more, is not part of the 671B and not counted)
    "deepseek-v3": {
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
    },
    # HuggingFaceTB/SmolLM2-135M-Instruct/config.json: 134.5M parameters (ctxpar's default model)
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
}
