"""Random projection weights held as the engine holds them after loading, one kind per
weight dtype of a profile, so that `ctxpar calibrate` times the engine's own linear
layer (``ctxpar.layers.linear.linear``) on each: fp32 and bf16 packed for the CPU's
kernels (a GPU's stay plain), q4 as a GGUF's Q4_0 blocks become the kernel's layout
(``QuantWeight.from_blocks``: 4-bit codes, a half scale per 32, ``zero`` 8), which
every row count multiplies in integers (int8 activations; AMX-INT8 or VNNI where the
CPU has them).
"""

from __future__ import annotations

import numpy as np
import torch

from ctxpar.costmodel.hardware import CALIBRATED_WEIGHT_DTYPES
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


def projection_weight(dtype: str, out: int, inp: int, device: torch.device, seed: int = 0) -> Weight:
    """A random (out, in) weight of ``dtype`` (a key of CALIBRATED_WEIGHT_DTYPES) in the engine's layout."""
    if dtype != "q4":
        generator = torch.Generator().manual_seed(seed)
        return packed(torch.randn(out, inp, generator=generator).to(device, ACTIVATION_DTYPES[dtype]))
    per_block, nbytes = Q4_0_BLOCK
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out, inp // per_block, nbytes), dtype=np.uint8)
    raw[:, :, 0:2] = np.full((out, inp // per_block, 1), Q4_0_SCALE, dtype=np.float16).view(np.uint8)
    return QuantWeight.from_blocks(raw.reshape(out, -1), "Q4_0", inp)


def activation_rows(dtype: str, rows: int, inp: int, device: torch.device) -> torch.Tensor:
    """Random (rows, in) inputs of a projection whose weights are ``dtype``."""
    return torch.randn(rows, inp, dtype=ACTIVATION_DTYPES[CALIBRATED_WEIGHT_DTYPES[dtype]], device=device)
