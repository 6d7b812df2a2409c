"""The interface every model implements, so the runner serves GQA and MLA alike,
and the hook through which a model offers a faster decode step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.kv_quant import KVQuant
from ctxpar.layers.linear import Weight


@dataclass(frozen=True)
class DecodeShape:
    """What a decode step's temporaries scale with: the model's widths and the activations' bytes."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    act_bytes: int

    def graph_bytes(self, batch: int, keys: int) -> int:
        """An upper bound of the memory one layer of a captured step holds at once (a
        graph pool keeps what its kernels wrote): the residual and normed states, QKV,
        gate-up and its product, the slot table, K and V gathered to (batch, keys), the
        scores and their exponentials, and the attention's output."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        states = batch * (3 * self.hidden + qkv + 3 * self.intermediate + self.heads * self.head_dim)
        gathered = 2 * batch * self.kv_heads * keys * self.head_dim
        scores = 2 * batch * self.heads * keys
        return (states + gathered + scores) * self.act_bytes + 8 * batch * keys  # int64 slot table


class FastDecode(Protocol):
    """A model's step of decodes computed faster than its forward, with the same bits."""

    def serves(self, ctx: ForwardContext, num_tokens: int) -> bool:
        """Whether this step is one it computes as the model's forward would."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The model's forward for a step ``serves`` accepts: (n,) ids and positions -> (n, hidden)."""
        ...


@dataclass(frozen=True)
class FastDecodeStep:
    """A model's fast decode paths (``CausalLM.fast_decode``), both from one description
    of its decoder layer: on a GPU its forward captured in CUDA graphs, whose memory
    ``shape`` bounds (ctxpar/worker/graph_runner.py); on the CPU a compiled loop over
    its layers, ``compile(kv_caches, kv_quant)``, or None where the loop does not take
    these weights or caches (ctxpar/models/compiled_decode.py)."""

    shape: DecodeShape
    compile: Callable[[list[torch.Tensor], KVQuant | None], FastDecode | None]


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
    # Optional: ``fast_decode() -> FastDecodeStep``, the model's fast decode paths (above),
    # asked once per rank after loading; a model without it runs every step in its forward,
    # and the runner says so once.

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; raises on a missing or unexpected name."""
        ...
