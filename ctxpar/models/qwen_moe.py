"""Qwen2-MoE and Qwen3-MoE: the Llama family's attention and decoder layer
(ctxpar/models/llama.py: Qwen2's QKV bias, Qwen3's q/k norm) with a mixture of
experts as the feed-forward (ctxpar/layers/moe.py, DeepSeek's expert layer).

As transformers computes them: a layer's experts where ``ModelArgs.is_moe_layer``
(every ``decoder_sparse_step``-th layer but ``mlp_only_layers``, which keep the
dense MLP); softmax scores over ``num_experts``, the top ``num_experts_per_tok``
taken, renormalised to sum to 1 where ``norm_topk_prob``; Qwen2-MoE adds one
shared expert of ``shared_expert_intermediate_size`` whose output a sigmoid gate
scales per token. Routing is computed in float32, the router's weight kept so.

Each expert is a module of its own, its projections packed (or kept quantized from
a GGUF) like a dense layer's, so a token's experts compute its rows alone: its
result depends only on its own inputs, whatever the other tokens routed with it.
On the CPU its decode steps run in the compiled decode loop (models/compiled_decode.py),
experts included, with the forward's bits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ctxpar.layers.moe import MoE, TopkRouter
from ctxpar.layers.quant_linear import MappedBlocks, QuantWeight
from ctxpar.model_args import ModelArgs
from ctxpar.models.base import FastDecodeStep
from ctxpar.models.llama import LlamaForCausalLM, LlamaMLP


class QwenMoeForCausalLM(LlamaForCausalLM):
    """CausalLM for ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM`` configs."""

    def __init__(self, config: ModelArgs) -> None:
        super().__init__(config)
        self.requires_grad_(False)  # the expert layer's parameters, frozen as Llama's are

    def feed_forward(self, config: ModelArgs, layer_idx: int) -> LlamaMLP | MoE:
        if not config.is_moe_layer(layer_idx):
            return LlamaMLP(config)
        assert config.num_experts and config.num_experts_per_tok and config.moe_intermediate_size  # ModelArgs checks
        router = TopkRouter(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            "greedy",
            n_group=None,
            topk_group=None,
            norm_topk_prob=bool(config.norm_topk_prob),
            routed_scaling_factor=1.0,
        )
        shared = config.shared_expert_intermediate_size or 0
        return MoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            n_shared_experts=1 if shared else 0,
            router=router,
            hidden_act=config.hidden_act,
            shared_intermediate_size=shared or None,
            shared_gate=bool(shared),
        )

    def fast_decode(self) -> FastDecodeStep | None:
        """Llama's on the CPU, where the compiled loop routes each row to its experts as
        ``MoE.forward`` does; None on a GPU: the expert layer's forward reads its routed counts
        back to the host, which a CUDA graph cannot capture, so its decodes run eagerly."""
        return super().fast_decode() if self.norm.weight.device.type == "cpu" else None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight | MappedBlocks]]) -> None:
        """As Llama's, Qwen2-MoE's ``mlp.shared_expert.*`` read as the expert layer's ``shared_experts``."""
        super().load_weights((name.replace(".mlp.shared_expert.", ".mlp.shared_experts."), w) for name, w in weights)
