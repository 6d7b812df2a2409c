"""Random projection weights held as the engine holds them after loading, one kind per
weight dtype of a profile, so that `ctxpar calibrate` times the engine's own linear
layer (``ctxpar.layers.linear.linear``) on each: fp32 and bf16 packed for the CPU's
kernels (a GPU's stay plain), q4 as a GGUF file's Q4_0 blocks, read where they lie
(``QuantWeight.in_place``: 4-bit codes and a half scale per 32, ``zero`` 8, fields a
block of 18 bytes apart, in memory advised huge as the engine's map of the file), as
loading leaves V, O, gate, up, down and the LM head (Q and K, whose rows the file
permutes, are copied out: ``QuantWeight.from_blocks``, ``layout="copied"``), which
every row count multiplies in integers (int8 activations; AMX-INT8 or VNNI where the
CPU has them).
"""

from __future__ import annotations

import numpy as np
import torch

from ctxpar.costmodel.hardware import CALIBRATED_WEIGHT_DTYPES
from ctxpar.kernels.huge_pages import huge_empty
from ctxpar.layers.linear import Weight, packed
from ctxpar.layers.quant_linear import QuantWeight

ACTIVATION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Q4_0_BLOCK = (32, 18)  # weights, bytes: a half scale and 16 bytes of nibbles (ggml-common.h)
# Q4_0 codes q in 0..15 stand for scale * (q - 8): std ~4.6 scales, weights of std ~0.02.
Q4_0_SCALE = 0.02 / 4.6


def quantized_on(device: torch.device) -> bool:
    """Whether the engine keeps quantized weights on ``device``: the CPU only (a GPU's
    would be dequantized for every call, which no engine step does)."""
    return device.type == "cpu"


def projection_weight(
    dtype: str, out: int, inp: int, device: torch.device, seed: int = 0, layout: str = "in place"
) -> Weight:
    """A random (out, in) weight of ``dtype`` (a key of CALIBRATED_WEIGHT_DTYPES) in the engine's
    layout; q4's ``layout`` "in place" (a file's blocks where they lie, as the engine reads most
    of a Q4_0 file's weights) or "copied" (the blocks' fields copied out: Q and K)."""
    if dtype != "q4":
        generator = torch.Generator().manual_seed(seed)
        return packed(torch.randn(out, inp, generator=generator).to(device, ACTIVATION_DTYPES[dtype]))
    per_block, nbytes = Q4_0_BLOCK
    blocks = huge_empty(out * inp // per_block * nbytes).numpy().reshape(out, inp // per_block, nbytes)
    blocks[...] = np.random.default_rng(seed).integers(0, 256, size=blocks.shape, dtype=np.uint8)
    blocks[:, :, 0:2] = np.full((out, inp // per_block, 1), Q4_0_SCALE, dtype=np.float16).view(np.uint8)
    raw = blocks.reshape(out, -1)
    if layout == "in place":
        return QuantWeight.in_place(raw, "Q4_0")
    if layout == "copied":
        return QuantWeight.from_blocks(raw, "Q4_0", inp)
    raise ValueError(f"projection_weight: layout must be 'in place' or 'copied', got {layout!r}")


def activation_rows(dtype: str, rows: int, inp: int, device: torch.device) -> torch.Tensor:
    """Random (rows, in) inputs of a projection whose weights are ``dtype``."""
    return torch.randn(rows, inp, dtype=ACTIVATION_DTYPES[CALIBRATED_WEIGHT_DTYPES[dtype]], device=device)
