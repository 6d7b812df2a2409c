"""Feed-forward blocks of DeepSeek-V2/V3 and Qwen-MoE: a gated dense MLP and a mixture of experts.

The MoE routes each token to ``num_experts_per_tok`` of ``n_routed_experts``
small gated MLPs and adds ``n_shared_experts`` always-on experts (fused into
one MLP of ``n_shared_experts * moe_intermediate_size``; Qwen2-MoE's one shared
expert has a width of its own and a sigmoid gate, ``shared_expert_gate``, scaling
its output per token). Two routers:

- ``"softmax"`` (DeepSeek-V2): softmax scores; ``greedy`` takes the top-k of
  all experts, ``group_limited_greedy`` first keeps the ``topk_group`` groups
  with the highest single expert score.
  Qwen2-MoE and Qwen3-MoE route as ``greedy`` does.
- ``"noaux_tc"`` (DeepSeek-V3): sigmoid scores; experts are *chosen* by
  score + ``e_score_correction_bias`` within the ``topk_group`` groups whose
  best two biased scores sum highest, but *weighted* by the unbiased score.

Weights are then optionally renormalised (``norm_topk_prob``) and multiplied
by ``routed_scaling_factor``. Routing is computed in float32 (as transformers
does: the gate is kept in fp32), since low precision flips expert choices.
On the CPU, ``greedy``'s softmax, top-k and renormalisation, and every sigmoid
here, are ctxpar's kernels (kernels/moe_route.cpp), which the compiled decode
loop (kernels/decode_loop.cpp) calls too: its steps are this forward's bits.

Experts are evaluated by a loop over the experts that received tokens, in
ascending order, each adding its weighted output to its tokens' rows: the
compiled decode loop adds them in that order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ctxpar.errors import CtxparError
from ctxpar.kernels import moe_route
from ctxpar.layers.activation import silu_and_mul
from ctxpar.layers.linear import Linear, linear


def activation(name: str):
    """act(gate, up) -> act(gate) * up. silu through silu_and_mul (ctxpar's kernel on the CPU):
    PyTorch's silu, like its sigmoid, computes the last few elements of a call another way
    than the rest, so an element's bits would depend on the size of the call; its gelu
    and relu do not."""
    fns = {"gelu": F.gelu, "relu": F.relu}
    if name in ("silu", "swish"):
        return lambda gate, up: silu_and_mul(torch.cat([gate, up], dim=-1))
    if name not in fns:
        raise CtxparError(f"unsupported hidden_act {name!r}; supported: {sorted(fns) + ['silu', 'swish']}")
    return lambda gate, up, act=fns[name]: act(gate) * up


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) elementwise, each element's bits its own (torch.sigmoid's are not:
    see ``activation``; torch.exp's are): the kernel's on the CPU, the decode loop's too."""
    if moe_route.usable(x):
        return moe_route.sigmoid(x)
    return torch.exp(-x).add_(1).reciprocal_()


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with Hugging Face parameter names."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.hidden_act = hidden_act
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class TopkRouter(nn.Module):
    """x (n, H) -> (weights (n, k) float32, expert ids (n, k) int64).

    Parameter names follow the checkpoints: ``gate.weight`` (E, H) and, for
    noaux_tc, ``gate.e_score_correction_bias`` (E,). Both are kept in float32.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        method: str,
        n_group: int | None,
        topk_group: int | None,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise CtxparError(
                f"unsupported MoE topk_method {method!r}; supported: greedy, group_limited_greedy, noaux_tc"
            )
        self.num_experts, self.top_k, self.method = num_experts, top_k, method
        self.n_group = n_group or 1
        self.topk_group = topk_group or self.n_group
        if num_experts % self.n_group != 0:
            raise CtxparError(f"n_routed_experts={num_experts} is not a multiple of n_group={self.n_group}")
        if top_k > num_experts:
            raise CtxparError(f"num_experts_per_tok={top_k} exceeds n_routed_experts={num_experts}")
        self.norm_topk_prob = bool(norm_topk_prob)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        # noaux_tc's, and only its, learned bias on the choice of experts
        self.e_score_correction_bias: nn.Parameter | None = None
        if method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """(n, n_group) -> (n, E) bool: experts in the topk_group best groups."""
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return mask.repeat_interleave(self.num_experts // self.n_group, dim=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x.float(), self.weight)  # (n, E); the weight float32 (packed by pack_for_cpu)
        per_group = self.num_experts // self.n_group
        if self.e_score_correction_bias is not None:  # noaux_tc
            scores = sigmoid(logits)
            choice = scores + self.e_score_correction_bias.float()
            if self.n_group > 1 and self.topk_group < self.n_group:
                group_scores = choice.view(-1, self.n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
                choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            idx = torch.topk(choice, k=self.top_k, dim=-1).indices
            weights = scores.gather(1, idx)
        elif self.method == "greedy" and moe_route.usable(logits):  # the decode loop's routing
            return moe_route.route(logits, self.top_k, self.norm_topk_prob, self.routed_scaling_factor)
        else:
            scores = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy" and self.topk_group < self.n_group:
                group_scores = scores.view(-1, self.n_group, per_group).amax(dim=-1)
                scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            weights, idx = torch.topk(scores, k=self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, idx


class MoE(nn.Module):
    """Routed experts plus shared experts, with checkpoint parameter names
    ``gate.*``, ``experts.{i}.{gate,up,down}_proj.weight``, ``shared_experts.*``."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        n_routed_experts: int,
        n_shared_experts: int,
        router: TopkRouter,
        hidden_act: str = "silu",
        shared_bias: bool = False,
        shared_intermediate_size: int | None = None,
        shared_gate: bool = False,
    ) -> None:
        """shared_intermediate_size: the shared experts' width (default n_shared_experts *
        moe_intermediate_size); shared_gate: their output scaled by sigmoid(shared_expert_gate(x))."""
        super().__init__()
        self.gate = router
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe_intermediate_size, hidden_act) for _ in range(n_routed_experts)
        )
        shared_width = shared_intermediate_size or moe_intermediate_size * n_shared_experts
        self.shared_experts = (
            GatedMLP(hidden_size, shared_width, hidden_act, bias=shared_bias) if n_shared_experts else None
        )
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)  # (n, k)
        out = torch.zeros_like(x)
        flat_idx = idx.flatten()
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=len(self.experts)).tolist()
        tokens = order // idx.shape[1]
        w = weights.flatten()[order].to(x.dtype)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            tok = tokens[start : start + c]
            y = self.experts[e](x.index_select(0, tok)) * w[start : start + c, None]
            out.index_add_(0, tok, y)
            start += c
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = sigmoid(self.shared_expert_gate(x)) * shared  # (n, 1) * (n, H)
            out = out + shared
        return out
