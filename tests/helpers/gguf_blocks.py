"""Random GGUF blocks for the kernel tests."""

from __future__ import annotations

import numpy as np

from ctxpar.layers.quant_blocks import FORMATS

# Byte ranges of each format's fp16 fields (d, and m / dmin where there is one).
FP16_FIELDS = {
    "Q8_0": [0],
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "Q3_K": [108],
    "Q2_K": [80, 82],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
}


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, cols / block * nbytes) random bytes whose fp16 fields are finite values of
    varied magnitude (random bytes would make some inf or NaN)."""
    fmt = FORMATS[name]
    blocks = rng.integers(0, 256, size=(rows * cols // fmt.block, fmt.nbytes), dtype=np.uint8)
    for start in FP16_FIELDS[name]:
        values = (rng.standard_normal(len(blocks)) * 10.0 ** rng.uniform(-4, 0, len(blocks))).astype(np.float16)
        blocks[:, start : start + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
