"""The interface every model implements, so the runner serves GQA and MLA alike."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.linear import Weight


class CausalLM(Protocol):
    # Shape of one token's KV-cache entry in one layer: (2, kv_heads, head_dim)
    # for MHA/GQA, (kv_lora_rank + qk_rope_head_dim,) for MLA. The paged cache
    # allocates (num_slots, *kv_entry_shape) per layer and knows nothing else.
    kv_entry_shape: tuple[int, ...]
    # Widths of the entry's runs that share one scale in a quantized cache
    # (ctxpar/layers/kv_quant.py): one per K or V head for GQA, latent and rope key for MLA.
    kv_scale_runs: tuple[int, ...]
    num_kv_layers: int

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: (n,) int64 -> hidden states (n, hidden_size). A model that
        takes per-token input states (the mtp draft layer) has a fourth argument,
        ``hidden`` (n, hidden_size), which the runner passes when the plan carries them."""
        ...

    def compute_logits(self, hidden: torch.Tensor, weight: Weight | None = None) -> torch.Tensor:
        """(m, hidden_size) -> (m, vocab_size) float32 logits: ``linear(hidden, logits_weight())``,
        or with ``weight`` a row range of logits_weight() (ranks that compute a range of the
        vocabulary each), the logits of that range."""
        ...

    def logits_weight(self) -> Weight:
        """The (vocab_size, hidden_size) lm_head, plain or packed (layers/linear.py),
        for ranks that compute the logits a range of the vocabulary each."""
        ...

    # Optional: ``pack_for_cpu()``, called by the loader after load_weights,
    # may replace projection weights by a faster CPU layout (layers/linear.py).

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; raises on a missing or unexpected name."""
        ...
