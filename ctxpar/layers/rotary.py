"""Rotary position embedding for every rope variant a Hugging Face config names.

The inverse frequencies and the cos/sin scaling ("attention_factor", e.g.
yarn's mscale) come from transformers' own rope initialisers, so llama3, yarn,
linear and dynamic scaling match the reference implementations bit for bit.
The default rope (no scaling) is computed here: transformers' module
(``transformers.modeling_rope_utils``) is imported only for another rope type,
so importing this module, and a model with the default rope, do not pay for it.
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

    def __init__(self, config, rot_dim: int) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, self.attention_scaling = _default_inv_freq(config, rot_dim)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        if inv_freq.numel() * 2 != rot_dim:
            raise ValueError(f"rope produced {inv_freq.numel() * 2} dims, expected {rot_dim}")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

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
    """``apply_rotary`` (half-split layout) in place on x (n, heads, rot_dim), whose
    heads are contiguous rows (tokens may be strided: a view into the QKV
    projection). Returns x."""
    rows = x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
    if rows and elementwise.usable(x) and elementwise.usable(cos, sin) and cos.dtype == torch.float32:
        elementwise.rope_(x, cos.contiguous(), sin.contiguous())
        return x
    return x.copy_(apply_rotary(x, cos, sin))
