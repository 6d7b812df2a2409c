"""Compiled CPU kernels, built on first use.

The kernels are the C++ files next to this one (decode and prefill
attention; fp32 projections against packed weights; projections against
block-quantized weights, wrapped in ``quant.py``; the layers' elementwise
steps, wrapped in ``elementwise.py``; a quantized KV cache's writes and
prefill reads, wrapped in ``kv_cache.py``); they include no PyTorch header, so
``g++ -O3 -march=native -fopenmp`` builds them into one library in a few
seconds (a PyTorch extension takes a minute). The library lands in ``<cache>/kernels`` under a name that
hashes the sources, the flags, the compiler and the CPU's flags (a
cache shared between machines never serves one CPU's build to another), and
is called through ctypes with the tensors' data pointers. Loading it runs its
code, so the directory and the library must be this user's and writable by
nobody else (ctxpar.paths); otherwise the library is built afresh in a private
temporary directory. The kernels trust the pointers and sizes they get: the
wrappers here check what a wrong layout would turn into an out-of-bounds
access, with real checks (``python -O`` drops ``assert``). Its OpenMP threads
are PyTorch's own: both load the same ``libgomp.so.1``, so
``torch.set_num_threads`` rules both.

``CTXPAR_KERNELS=0`` turns the kernels off (the PyTorch path then runs, as
it does on a device other than the CPU). Without a working compiler they are
off too, with one warning that says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path
from typing import Protocol

import torch

from ctxpar.machine import cpu_info
from ctxpar.paths import cache_dir, refusal, temporary_dir, warn_refused

FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))  # built together into one library
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {  # name: (argument types, result type)
    "paged_decode_f32": ([_ptr] * 4 + [_i64] * 8 + [_f32, _ptr, _ptr], None),
    "paged_decode_bf16": ([_ptr] * 4 + [_i64] * 8 + [_f32, _ptr, _ptr], None),
    "paged_decode_quant": ([_ptr] * 4 + [_i64] * 13 + [_f32, _ptr, _ptr], None),
    "prefill_attention_f32": ([_ptr] * 3 + [_i64] * 10 + [_ptr, _f32, _ptr, _ptr], None),
    "prefill_attention_quant": ([_ptr] * 2 + [_i64] * 10 + [_ptr] + [_i64] * 4 + [_f32, _ptr, _ptr], None),
    "prefill_attention_supports": ([_i64, _i64], ctypes.c_int),
    "kv_quantize": ([_ptr, _i64, _i64, _ptr] + [_i64] * 4 + [_ptr], None),
    "rms_norm_f32": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32, _ptr], None),
    "silu_mul_f32": ([_ptr, _i64, _i64, _ptr], None),
    "rope_f32": ([_ptr] + [_i64] * 4 + [_ptr, _ptr], None),
    "hadamard_f32": ([_ptr] + [_i64] * 4 + [_f32], None),
    "linear_packed_f32": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "linear_packed_bf16": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "linear_packed_bf16_out": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "linear_panel_width": ([], _i64),
    "linear_bf16_tiles": ([], _i64),
    "quant_linear_f32": ([_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "quant_dequantize_f32": ([_ptr, _ptr, _ptr] + [_i64] * 7 + [_ptr], None),
    "llama_decode_layers": ([_ptr, _i64, _ptr, _ptr] + [_i64] * 6 + [_f32] + [_ptr] * 5 + [_f32], None),
    "shm_barrier": ([_ptr, _i64, _i64, _i64, _i64, _ptr, ctypes.c_double], _i64),
}


# A quantized cache's code dtypes, by the number the kernels know them by (kv_codes.h).
CODES = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


class QuantRows(Protocol):
    """A quantized cache's row format as the kernels read it (ctxpar.layers.kv_quant.KVQuant):
    rows of 1-byte codes, the entry's values in order, then float32 scales at scale_offset."""

    @property
    def codes(self) -> torch.dtype: ...
    @property
    def entry_shape(self) -> tuple[int, ...]: ...
    @property
    def scale_offset(self) -> int: ...


def enabled() -> bool:
    return os.environ.get("CTXPAR_KERNELS", "1") != "0"


def available() -> bool:
    """Whether the kernels serve: enabled (CTXPAR_KERNELS is not 0) and built."""
    return enabled() and _library() is not None


def _build_dir() -> Path:
    """``<cache>/kernels`` if it may be used (ctxpar.paths.cache_dir), else a private
    directory of this process under the system's temporary one."""
    return cache_dir("kernels") or temporary_dir("kernels")


def _trusted_library(path: Path) -> Path:
    """``path``, or the same name in a private temporary directory if a library
    there may not be loaded (dlopen runs its code): refused with a warning."""
    try:
        why = refusal(path)
    except FileNotFoundError:
        return path
    if why is None:
        return path
    warn_refused(f"the kernel library {path}", f"it {why}")
    return temporary_dir("kernels") / path.name


def loaded() -> ctypes.CDLL:
    """The kernel library, for callers that checked ``available()`` (or a test that
    patched ``_library``): its absence here is a bug, not a fallback."""
    lib = _library()
    if lib is None:
        raise RuntimeError("ctxpar's kernels are not built; check kernels.available() before calling them")
    return lib


def _library_name(flags: list[str], compiler_version: str) -> str:
    """The library's file name, ``ctxpar_kernels-<key>.so``: the key hashes the
    sources, the flags, the compiler and the CPU's flags."""
    texts = [f.read_text() for f in [*SOURCES, *sorted(HERE.glob("*.h"))]]
    parts = [*texts, *flags, compiler_version, " ".join(sorted(cpu_info().flags))]
    return f"ctxpar_kernels-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"


@cache
def _library(march: str = "native") -> ctypes.CDLL | None:
    """The built kernel library, building it if needed; None if it cannot be built.
    march: the target CPU (``native``: this one; the tests also build an AVX2-only
    ``haswell`` library to check the code path of CPUs without AVX-512)."""
    flags = [*FLAGS, f"-march={march}"]
    compiler = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(
            f"ctxpar: no C++ compiler ({compiler}: {e}); attention runs on the slower PyTorch path. "
            "Install g++ (or set CXX) to build ctxpar's kernels."
        )
        return None
    path = _trusted_library(_build_dir() / _library_name(flags, version))
    if not path.exists():
        # Build under a temporary name, then rename: ranks that start together may
        # build at once, and none may load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        build = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if build.returncode != 0:
            os.unlink(tmp)
            warnings.warn(
                f"ctxpar: building the kernels in {HERE} failed; attention runs on the slower PyTorch "
                f"path:\n{build.stderr[-2000:]}"
            )
            return None
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask: keep it this user's alone
        os.replace(tmp, path)
    lib = ctypes.CDLL(str(path))
    for name, (args, result) in SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = result
    return lib


def usable(cache: torch.Tensor, *widths: int) -> bool:
    """Whether the kernels serve attention over this cache with keys and values
    of these widths: a contiguous float32, bfloat16 or quantized (uint8 rows) CPU
    tensor, widths that are multiples of 8 (the kernel's vectors), kernels enabled
    and built."""
    return (
        cache.device.type == "cpu"
        and cache.dtype in (torch.float32, torch.bfloat16, torch.uint8)
        and cache.is_contiguous()
        and all(w % 8 == 0 for w in widths)
        and available()
    )


def paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    kv_heads: int,
    value_dim: int,
    strides: tuple[int, int, int],
    scale: float,
    scales: tuple[QuantRows, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over that row's cache slots, read in place.

    q (B, H, D); cache: a ``usable`` cache; slots (N,) int64 the rows' slots
    back to back, row b's at [starts[b], starts[b+1]) (starts (B+1,) int64);
    strides: in cache elements, (per slot, per KV head, from a key to its
    value). Query head i uses KV head i // (H / kv_heads). scales, for a
    quantized cache: its format and kv_codes.h's (head, value, split) scale
    indices. Returns out (B, H, value_dim) and lse (B, H), float32; a row
    without keys gets out 0 and lse -inf.
    """
    rows, heads, dim = q.shape
    # The kernel reads slots and starts as int64 arrays of these lengths; the slots'
    # values are checked once per step, against the cache, by the model runner.
    if slots.dtype != torch.int64 or starts.dtype != torch.int64 or starts.shape != (rows + 1,):
        raise ValueError(
            f"paged_decode: slots and starts must be int64, starts ({rows + 1},); got {slots.dtype}, "
            f"{starts.dtype} {tuple(starts.shape)}"
        )
    q = q.to(torch.float32).contiguous()
    slots, starts = slots.contiguous(), starts.contiguous()
    out = torch.empty(rows, heads, value_dim, dtype=torch.float32)
    lse = torch.empty(rows, heads, dtype=torch.float32)
    pointers = (q.data_ptr(), cache.data_ptr(), slots.data_ptr(), starts.data_ptr())
    sizes = (rows, heads, kv_heads, dim, value_dim, *strides)
    if scales is not None:
        fmt, *indices = scales
        quant_args = (CODES[fmt.codes], fmt.scale_offset, *indices)
        loaded().paged_decode_quant(*pointers, *sizes, *quant_args, scale, out.data_ptr(), lse.data_ptr())
    else:
        kernel = loaded().paged_decode_f32 if cache.dtype == torch.float32 else loaded().paged_decode_bf16
        kernel(*pointers, *sizes, scale, out.data_ptr(), lse.data_ptr())
    return out, lse


def gqa_paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
    quant: QuantRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_decode`` over a GQA cache (num_slots, 2, Hk, D): K and V of slot s
    at s*2*Hk*D + h*D and Hk*D further on; or over its quantized rows
    (num_slots, row_bytes) in the same order, one scale per K or V head (K heads'
    first). Returns out (B, H, D), lse (B, H)."""
    _, Hk, D = quant.entry_shape if quant is not None else cache.shape[1:]
    scales = (quant, 1, Hk, D) if quant is not None else None
    return paged_decode(q, cache, slots, starts, Hk, D, (cache.stride(0), D, Hk * D), scale, scales)


def latent_paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    value_dim: int,
    scale: float,
    quant: QuantRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_decode`` over MLA latents (num_slots, E): one key per slot shared
    by every head, whose first value_dim entries are the value; or over their
    quantized rows, the latent (the first value_dim) with one scale, the rope
    key with another. Returns out (B, H, value_dim), lse (B, H)."""
    scales = (quant, 0, 0, value_dim) if quant is not None else None
    return paged_decode(q, cache, slots, starts, 1, value_dim, (cache.stride(0), 0, 0), scale, scales)


def prefill_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``prefill_attention`` takes these: float32 CPU tensors whose
    heads are contiguous rows, widths the kernel's vectors divide, kernels on."""
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.float32
        and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k, v))
        and available()
        and bool(loaded().prefill_attention_supports(q.shape[-1], v.shape[-1]))
    )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = True,
    out: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of L queries over S keys, grouped-query heads: q (L, H, D),
    k (S, Hk, D), v (S, Hk, Dv), all ``prefill_usable`` (views with strided
    tokens are fine). counts (L,) int64, if given: query i sees keys
    [0, counts[i]), 1 <= counts[i] <= S; else causal: the queries are the last
    L of the S keys (bottom-right aligned, L <= S), or every query sees every
    key. Returns out (L, H, Dv), written into `out` if given (contiguous
    float32), and lse (L, H), float32."""
    (L, H, D), (S, Hk, _), Dv = q.shape, k.shape, v.shape[-1]
    if k.shape[-1] != D or v.shape[:2] != (S, Hk) or H % Hk or (causal and counts is None and L > S):
        raise ValueError(
            f"prefill_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
            "(k's width must be q's, v as many keys and heads as k, heads a multiple of k's, L <= S if causal)"
        )
    out = attention_out(out, (L, H, Dv), "prefill_attention")
    lse = torch.empty(L, H, dtype=torch.float32)
    loaded().prefill_attention_f32(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        L,
        S,
        H,
        Hk,
        D,
        Dv,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        int(causal),
        key_counts(counts, L, S),
        scale,
        out.data_ptr(),
        lse.data_ptr(),
    )
    return out, lse


def attention_out(out: torch.Tensor | None, shape: tuple[int, int, int], name: str) -> torch.Tensor:
    """``out`` checked to be what the attention kernels write, or a new one."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    if out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous float32 {shape} tensor, got {out.dtype} {tuple(out.shape)}")
    return out


def key_counts(counts: torch.Tensor | None, L: int, S: int) -> int | None:
    """The address of the per-query key counts the prefill kernels read (None: no counts),
    checked: (L,) contiguous int64 on the CPU, each in [1, S]."""
    if counts is None:
        return None
    if counts.shape != (L,) or counts.dtype != torch.int64 or not counts.is_contiguous() or counts.device.type != "cpu":
        got = f"{counts.dtype} {tuple(counts.shape)} on {counts.device}"
        raise ValueError(f"key counts must be a contiguous int64 ({L},) CPU tensor, got {got}")
    if L and (int(counts.min()) < 1 or int(counts.max()) > S):
        raise ValueError(f"key counts must lie in [1, {S}], got [{int(counts.min())}, {int(counts.max())}]")
    return counts.data_ptr()


def panel_width() -> int:
    """Output rows per panel of the packed weight layout (kernels/gemv.cpp)."""
    return loaded().linear_panel_width()


def bf16_tiles() -> bool:
    """Whether bf16 projections run on AMX's tiles (kernels/bf16_tiles.h: a CPU with
    AMX-BF16 that the kernel may use), else on the panel loop (kernels/gemv.cpp)."""
    return bool(loaded().linear_bf16_tiles())


def linear_packed(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x (n, in) @ W^T (+ bias) -> (n, out_features) out_dtype, rows of x contiguous
    (tokens may be strided). W packed float32 (ceil(out / panel_width), in,
    panel_width) with x float32, or bfloat16 (ceil(out / panel_width), ceil(in / 2),
    panel_width, 2) with x bfloat16 (gemv.cpp's layouts). With a bfloat16 packing,
    out_dtype bfloat16 has the kernel write bf16, the bits ``.to(torch.bfloat16)`` of
    the float32 result gives, at half the bytes."""
    n, in_features = x.shape
    # The kernel reads ceil(out / panel_width) panels of the packing's width, and out_features biases.
    if (
        packed.dim() < 3
        or packed.shape[2] != panel_width()
        or packed.shape[0] * packed.shape[2] < out_features
        or not packed.is_contiguous()
    ):
        raise ValueError(
            f"linear_packed: the packed weight {tuple(packed.shape)} (contiguous: {packed.is_contiguous()}) "
            f"does not hold {out_features} output rows"
        )
    if bias is not None and bias.numel() != out_features:
        raise ValueError(f"linear_packed: bias has {bias.numel()} values for {out_features} outputs")
    bf16_out = packed.dtype == torch.bfloat16 and out_dtype == torch.bfloat16
    if out_dtype not in (torch.float32, torch.bfloat16) or (out_dtype == torch.bfloat16 and not bf16_out):
        raise ValueError(f"linear_packed: out_dtype {out_dtype} with a {packed.dtype} packing")
    out = torch.empty(n, out_features, dtype=torch.bfloat16 if bf16_out else torch.float32)
    bias_ptr = 0 if bias is None else bias.float().contiguous().data_ptr()
    if packed.dtype == torch.bfloat16:
        if packed.shape[1] != -(-in_features // 2) or x.dtype != torch.bfloat16:
            raise ValueError(
                f"linear_packed: a bfloat16 packing {tuple(packed.shape)} takes bfloat16 x of "
                f"{2 * packed.shape[1] - 1} or {2 * packed.shape[1]} features, got {x.dtype} {tuple(x.shape)}"
            )
        if in_features % 2 or x.stride(0) % 2 or x.stride(1) != 1 or x.data_ptr() % 4:  # read in aligned pairs
            x = torch.nn.functional.pad(x, (0, in_features % 2))
        kernel = loaded().linear_packed_bf16_out if bf16_out else loaded().linear_packed_bf16
        kernel(x.data_ptr(), x.stride(0), n, packed.data_ptr(), packed.shape[1], out_features, bias_ptr, out.data_ptr())
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if packed.shape[1] != in_features or x.dtype != torch.float32 or packed.dtype != torch.float32:
        raise ValueError(
            f"linear_packed: a {packed.dtype} packing {tuple(packed.shape)} takes float32 x of "
            f"{packed.shape[1]} features, got {x.dtype} {tuple(x.shape)}"
        )
    loaded().linear_packed_f32(
        x.data_ptr(), x.stride(0), n, packed.data_ptr(), in_features, out_features, bias_ptr, out.data_ptr()
    )
    return out
