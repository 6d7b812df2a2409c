"""Devices and dtypes: the ``dtype`` argument's spellings, what ``"auto"``
picks, the torch dtype of a canonical name, and the device a rank runs on.

Accepted, as in vLLM: ``"auto"``, ``"float32"``/``"float"``, ``"float16"``/
``"half"``, ``"bfloat16"``, and the torch dtypes themselves. Anything else is
refused with the list. EngineConfig stores the canonical name.

``"auto"`` is bf16 where the hardware computes bf16 natively and it is
faster (a CUDA GPU with bf16; a CPU with AVX-512 BF16 or AMX, where oneDNN's
bf16 GEMMs beat fp32 on SmolLM2's shapes, since decode reads every weight
per step), else fp32. fp32 stays the default and
the exact path: bf16 changes the numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctxpar.errors import CtxparError
from ctxpar.machine import cpu_info

if TYPE_CHECKING:  # torch is imported where it is used: `ctxpar --help` stays instant
    import torch

CANONICAL = ("float32", "bfloat16", "float16")
SPELLINGS = {
    "float32": "float32", "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16", "half": "float16",
}  # fmt: skip
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def canonical_dtype(value: object, device: str = "auto") -> str:
    """A dtype spelling (string or torch dtype) -> "float32" | "bfloat16" | "float16"."""
    name = value
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        name = str(value).removeprefix("torch.")
    if name == "auto":
        return auto_dtype(device)
    if isinstance(name, str) and name in SPELLINGS:
        return SPELLINGS[name]
    raise CtxparError(
        f"dtype must be one of 'auto', {', '.join(repr(s) for s in SPELLINGS)} or the matching torch dtype, "
        f"got {value!r}; float32 is the exact path"
    )


def cpu_has_native_bf16() -> bool:
    return any(flag in cpu_info().flags for flag in NATIVE_BF16_FLAGS)


def auto_dtype(device: str) -> str:
    import torch

    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if on_cuda:
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def torch_dtype(name: str) -> torch.dtype:
    """A canonical dtype name (EngineConfig.dtype) -> the torch dtype."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    """EngineConfig.device ("auto", "cpu", "cuda") -> the device of the rank with
    this local rank: the CPU, or one GPU per rank."""
    import torch

    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CtxparError("device='cuda' was requested but no CUDA device is available; use device='cpu'")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def bind_device(device: torch.device) -> None:
    """Make a rank's GPU its current device (nothing to do on the CPU), first thing in the
    rank: NCCL's communicators and every call that means "the current device" (a
    synchronize, library handles, the bf16 check of dtype "auto") then use this rank's
    GPU, not GPU 0 in every rank (a context and memory on GPU 0 per rank, and NCCL
    communicators of two ranks on one GPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)
