"""DeepSeek-V3's multi-token-prediction (MTP) layer, a draft model for speculative decoding
(speculative_config method "mtp").

A V3 checkpoint with ``num_nextn_predict_layers`` = 1 carries one more decoder layer
after the last one (``model.layers.{L}.*``, L = num_hidden_layers) with its own
embedding, norms, a projection and an output head. At position i it combines the
target model's final (normed) hidden state h_i with the embedding of the next
token t_{i+1} and predicts t_{i+2}:

    t_{i+1} ─► embed ─► enorm ─┐
                               ├─ cat ─► eh_proj ─► decoder layer ─► g_i ─► shared_head (norm, head) ─► t_{i+2}
    h_i ──────────────► hnorm ─┘                   (its own KV cache)

So the layer's KV at position i depends on the target's state there. To draft k
tokens, the layer runs once over the positions it has not seen (the target's
states and the known tokens), then k - 1 times on its own output: the next
position's input is (g_i, the draft just drawn), as vLLM's MTP proposer does. The
order of the concatenation (embedding first) and the use of the target's normed
state follow vLLM's DeepSeek MTP, which runs the published checkpoints. Of several
MTP layers only the first is used (vLLM's V1 engine does the same).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.linear import Linear, Weight, can_pack, linear, packed
from ctxpar.layers.norm import RMSNorm
from ctxpar.layers.rotary import RotaryEmbedding
from ctxpar.models.deepseek import DeepseekLayerBody, load_named, pack_projections, split_fused


class _SharedHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class DeepseekMTP(DeepseekLayerBody):
    """The first MTP layer of a DeepSeek-V3 checkpoint, as a one-layer model whose forward
    also takes the target's hidden states. Parameter names are the checkpoint's without
    the ``model.layers.{L}.`` prefix."""

    def __init__(self, config, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> None:
        dtype = dtype or torch.get_default_dtype()
        device = torch.device(device) if device is not None else torch.get_default_device()
        with torch.device("meta"):
            super().__init__(config, config.num_hidden_layers, "v3", cache_idx=0)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
            self.shared_head = _SharedHead(config)
        self.to_empty(device=device)
        for name, p in self.named_parameters():
            p.requires_grad_(False)
            if not name.endswith(("gate.weight", "gate.e_score_correction_bias")):  # float32, as in the target
                p.data = p.data.to(dtype)
        self.config = config
        self.prefix = f"model.layers.{config.num_hidden_layers}."
        self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim).to(device)
        self.kv_entry_shape = (config.kv_lora_rank + config.qk_rope_head_dim,)
        self.kv_scale_runs = (config.kv_lora_rank, config.qk_rope_head_dim)
        self.num_kv_layers = 1
        self.head_packed: Weight | None = None  # see pack_for_cpu

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, hidden: torch.Tensor
    ) -> torch.Tensor:
        """input_ids (n,): t_{i+1} at position i; hidden (n, H): the target's h_i (or, past the
        known tokens, this layer's own output at i - 1) -> g (n, H), before the head's norm."""
        e = self.enorm(self.embed_tokens(input_ids))
        x = linear(torch.cat([e, self.hnorm(hidden.to(e.dtype))], dim=-1), self.eh_proj.weight)  # (n, H)
        cos, sin = self.rotary(positions)
        return self.body(x, cos, sin, ctx)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, weight: Weight | None = None) -> torch.Tensor:
        return linear(self.shared_head.norm(hidden), weight if weight is not None else self.logits_weight()).float()

    def logits_weight(self) -> Weight:
        return self.shared_head.head.weight if self.head_packed is None else self.head_packed

    def pack_for_cpu(self) -> None:
        pack_projections(self)  # the layer's, and eh_proj
        if can_pack(self.shared_head.head.weight):
            self.head_packed = packed(self.shared_head.head.weight)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """From the whole checkpoint's tensors, the first MTP layer's. A checkpoint whose MTP
        layer leaves out its embedding or head (V3 shares them with the model) gets the
        model's ``model.embed_tokens`` / ``lm_head`` (or the embedding, when tied)."""
        shared = {}
        mine: list[tuple[str, torch.Tensor]] = []
        for name, t in weights:
            if name.startswith(self.prefix):
                mine += [(n[len(self.prefix) :], x) for n, x in split_fused(name, t)]
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                shared[name] = t
        have = {n for n, _ in mine}
        embed = shared.get("model.embed_tokens.weight")
        fallbacks = {"embed_tokens.weight": embed, "shared_head.head.weight": shared.get("lm_head.weight", embed)}
        load_named(self, mine + [(n, t) for n, t in fallbacks.items() if n not in have and t is not None])
