"""Rotary position embedding for every rope variant a Hugging Face config names.

The inverse frequencies and the cos/sin scaling ("attention_factor", e.g.
yarn's mscale) come from transformers' own rope initialisers, so llama3, yarn,
linear and dynamic scaling match the reference implementations bit for bit.
The default rope (no scaling) is computed here: transformers' module
(``transformers.modeling_rope_utils``) is imported only for another rope type,
so importing this module, and a model with the default rope, do not pay for it.

LongRoPE (Phi-3-mini-128k, Phi-3.5-mini) has two sets of frequency factors: the short ones
for a context up to ``original_max_position_embeddings``, the long ones beyond. transformers
picks per forward pass by the largest position in it, so a sequence's earlier keys were turned
by the short factors and its later queries by the long ones once it outgrows the original
context, and a token's rotation depends on how far its sequence has got. ctxpar picks once, by
the context the model is loaded for (``max_model_len``: ``RotaryEmbedding.fit_context``), as
vLLM does (Phi3LongRoPEScaledRotaryEmbedding's ``use_long_rope``: max_model_len beyond the
original context) and llama.cpp by its context size (llama_model::get_rope_factors): every
token of every sequence turns by the same table, its bits its own. The two agree wherever transformers sees a
whole sequence in one pass whose length is on the same side of the original context as
``max_model_len`` (short prompts with a max_model_len up to the original context, prompts longer
than it with a larger one); a short prompt in a model loaded for a long context turns by the
long factors here and by the short ones in transformers.
"""

from __future__ import annotations

import torch
from torch import nn

from ctxpar.kernels import elementwise


def _default_inv_freq(config, dim: int) -> tuple[torch.Tensor, float]:
    base = config.rope_parameters["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0


class RotaryEmbedding(nn.Module):
    """positions (n,) -> cos, sin (n, rot_dim // 2), already multiplied by the rope's attention factor."""

    inv_freq: torch.Tensor  # a buffer (moves with .to(), not saved)

    def __init__(self, config, head_dim: int) -> None:
        """The rope of heads of ``head_dim``: their first rot_dim dims, all of them but where the
        config's rope has a partial_rotary_factor (Phi-4-mini turns 3/4 of each head, as
        transformers' initialisers size the tables: int(head_dim * factor)). A longrope's factors
        are those of the config's own context (max_position_embeddings) until ``fit_context``
        names the one the model is loaded for."""
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        self.config, self.rot_dim = config, int(head_dim * (params.get("partial_rotary_factor") or 1.0))
        self.rope_type = params.get("rope_type", "default")
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.fit_context(getattr(config, "max_position_embeddings", None))

    def fit_context(self, context: int | None) -> None:
        """The tables for a model that runs sequences of up to ``context`` tokens: a longrope's
        long factors where that is beyond its original context, else its short ones (the module
        docstring says why once per model); every other rope is the same at any context."""
        if self.rope_type == "default":
            inv_freq, self.attention_scaling = _default_inv_freq(self.config, self.rot_dim)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            # seq_len: longrope's choice of factors (the long ones where it exceeds the original context)
            length = {"seq_len": context} if self.rope_type == "longrope" else {}
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, "cpu", **length)
        if inv_freq.numel() * 2 != self.rot_dim:
            raise ValueError(f"rope produced {inv_freq.numel() * 2} dims, expected {self.rot_dim}")
        self.inv_freq = inv_freq.float().to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (n, rot_dim/2)
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x (n, heads, rot_dim) by cos/sin (n, rot_dim/2).

    Half-split layout (Llama, "neox"): pairs are (i, i + rot_dim/2).
    Interleaved layout (DeepSeek-V3 default): pairs are (2i, 2i + 1).
    """
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` (half-split layout) in place on the first rot_dim dims of each head of
    x (n, heads, head_dim), cos/sin (n, rot_dim/2): a partial rotary factor's rope (transformers'
    Phi-3 turns q[..., :rot_dim] and passes the rest) where rot_dim < head_dim. Its heads are
    contiguous rows (tokens may be strided: a view into the QKV projection). Returns x."""
    rows = x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
    if rows and elementwise.usable(x) and elementwise.usable(cos, sin) and cos.dtype == torch.float32:
        elementwise.rope_(x, cos.contiguous(), sin.contiguous())
        return x
    turned = x[..., : 2 * cos.shape[-1]]  # (n, heads, rot_dim)
    turned.copy_(apply_rotary(turned, cos, sin))
    return x
