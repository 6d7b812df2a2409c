"""A random transformers model of a config, saved as a checkpoint: what `ctxpar
calibrate` times the engine's host overhead on (its kernels take next to nothing),
and what the tests and `ctxpar bench cuda` compare ctxpar with transformers on."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any


def save_random_model(config: Any, path: Path, seed: int, scale: float = 2.0) -> Path:
    """A random transformers model of ``config``, saved as a checkpoint: matrices times
    ``scale`` (so that the top logits are rarely near-ties), vectors (zero biases, unit
    norms) perturbed so that loading them is tested too."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
            else:
                p.add_(0.2 * torch.randn_like(p))
    # A second's write: no progress bar in the middle of a command's lines (calibrate, bench links).
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return path
