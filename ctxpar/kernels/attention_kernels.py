"""Every attention kernel of ctxpar, and the checks their raw pointers need:
decode rows over their paged cache slots, read in place (paged_decode.cpp);
prefill queries over their keys, causal or with a key count per query (DCP's
shards), in float32, in bf16 on AMX's tiles (prefill_attention.cpp,
prefill_tiles.cpp), or over a quantized cache's rows, dequantized block by
block. The layers reach them through one backend (ctxpar/layers/attention/backend.py)."""

from __future__ import annotations

from typing import Protocol

import torch

from ctxpar import kernels

CODES = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# A multiple of every prefill kernel's keys per block (prefill_attention.cpp's BK 64,
# prefill_tiles.cpp's 128): keys dropped from the front in whole runs of this many leave
# every block's keys as they were, and so a query's bits (a window's callers drop the
# keys before every query's window so).
KEY_BLOCK_ALIGN = 128


class QuantRows(Protocol):
    """A quantized cache's row format as the kernels read it (ctxpar.layers.kv_quant.KVQuant):
    rows of 1-byte codes, the entry's values in order, then float32 scales at scale_offset."""

    @property
    def codes(self) -> torch.dtype: ...
    @property
    def entry_shape(self) -> tuple[int, ...]: ...
    @property
    def scale_offset(self) -> int: ...


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
        and kernels.available()
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
    window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over that row's cache slots, read in place.

    q (B, H, D); cache: a ``usable`` cache; slots (N,) int64 the rows' slots
    back to back, row b's at [starts[b], starts[b+1]) (starts (B+1,) int64);
    strides: in cache elements, (per slot, per KV head, from a key to its
    value). Query head i uses KV head i // (H / kv_heads). scales, for a
    quantized cache: its format and kv_codes.h's (head, value, split) scale
    indices. window: a row sees only its last ``window`` slots (its keys in
    position order, its own last: a sliding window); soft_cap: logits x become
    soft_cap · tanh(x / soft_cap). Returns out (B, H, value_dim) and lse (B, H),
    float32; a row without keys gets out 0 and lse -inf.
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
    variant = (scale, window or 0, soft_cap or 0.0)
    if scales is not None:
        fmt, *indices = scales
        quant_args = (CODES[fmt.codes], fmt.scale_offset, *indices)
        kernels.loaded().paged_decode_quant(*pointers, *sizes, *quant_args, *variant, out.data_ptr(), lse.data_ptr())
    else:
        kernel = (
            kernels.loaded().paged_decode_f32 if cache.dtype == torch.float32 else kernels.loaded().paged_decode_bf16
        )
        kernel(*pointers, *sizes, *variant, out.data_ptr(), lse.data_ptr())
    return out, lse


def gqa_paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
    quant: QuantRows | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_decode`` over a GQA cache (num_slots, 2, Hk, D): K and V of slot s
    at s*2*Hk*D + h*D and Hk*D further on; or over its quantized rows
    (num_slots, row_bytes) in the same order, one scale per K or V head (K heads'
    first); window and soft_cap as there. Returns out (B, H, D), lse (B, H)."""
    _, Hk, D = quant.entry_shape if quant is not None else cache.shape[1:]
    scales = (quant, 1, Hk, D) if quant is not None else None
    strides = (cache.stride(0), D, Hk * D)
    return paged_decode(q, cache, slots, starts, Hk, D, strides, scale, scales, window, soft_cap)


def latent_paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    value_dim: int,
    scale: float,
    quant: QuantRows | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_decode`` over MLA latents (num_slots, E): one key per slot shared
    by every head, whose first value_dim entries are the value; or over their
    quantized rows, the latent (the first value_dim) with one scale, the rope
    key with another; window and soft_cap as there. Returns out (B, H, value_dim), lse (B, H)."""
    scales = (quant, 0, 0, value_dim) if quant is not None else None
    strides = (cache.stride(0), 0, 0)
    return paged_decode(q, cache, slots, starts, 1, value_dim, strides, scale, scales, window, soft_cap)


def prefill_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``prefill_attention`` takes these: CPU tensors of one dtype whose heads
    are contiguous rows, kernels on, and a kernel for that dtype and these widths:
    float32 (widths its vectors divide), or bf16 on a CPU with AMX-BF16 (Q/K widths
    a multiple of 32 up to 192, V of 16)."""
    if not (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (torch.float32, torch.bfloat16)
        and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k, v))
        and kernels.available()
    ):
        return False
    lib = kernels.loaded()
    supports = lib.prefill_attention_supports if q.dtype == torch.float32 else lib.prefill_attention_bf16_supports
    return bool(supports(q.shape[-1], v.shape[-1]))


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = True,
    out: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    firsts: torch.Tensor | None = None,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of L queries over S keys, grouped-query heads: q (L, H, D),
    k (S, Hk, D), v (S, Hk, Dv), all ``prefill_usable`` (views with strided
    tokens are fine). counts (L,) int64, if given: query i sees keys
    [0, counts[i]), 1 <= counts[i] <= S; else causal: the queries are the last
    L of the S keys (bottom-right aligned, L <= S), or every query sees every
    key. firsts (L,) int64, if given: query i sees no key before firsts[i] (a
    sliding window; a query left no key gets out 0, lse -inf); soft_cap: logits x
    become soft_cap · tanh(x / soft_cap). Returns out (L, H, Dv), written into
    `out` if given (contiguous float32), and lse (L, H), float32. bf16 inputs take
    AMX's tiles (prefill_tiles.cpp: softmax weights rounded to bf16 for P · V)."""
    (L, H, D), (S, Hk, _), Dv = q.shape, k.shape, v.shape[-1]
    if k.shape[-1] != D or v.shape[:2] != (S, Hk) or H % Hk or (causal and counts is None and L > S):
        raise ValueError(
            f"prefill_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
            "(k's width must be q's, v as many keys and heads as k, heads a multiple of k's, L <= S if causal)"
        )
    out = attention_out(out, (L, H, Dv), "prefill_attention")
    lse = torch.empty(L, H, dtype=torch.float32)
    lib = kernels.loaded()
    kernel = lib.prefill_attention_f32 if q.dtype == torch.float32 else lib.prefill_attention_bf16
    kernel(
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
        key_counts(firsts, L, S, 0),
        scale,
        soft_cap or 0.0,
        out.data_ptr(),
        lse.data_ptr(),
    )
    return out, lse


def prefill_quant_usable(q: torch.Tensor, quant: QuantRows) -> bool:
    """Whether ``prefill_attention_quant`` takes these queries over a GQA cache of this format."""
    _, _, D = quant.entry_shape
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and q.stride(-1) == 1
        and q.stride(-2) == q.shape[-1]
        and kernels.available()
        and bool(kernels.loaded().prefill_attention_supports(D, D))
    )


def prefill_attention_quant(
    q: torch.Tensor,
    rows: torch.Tensor,
    quant: QuantRows,
    scale: float,
    causal: bool = True,
    out: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    firsts: torch.Tensor | None = None,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefill_attention`` over S quantized rows (S, row_bytes) of a GQA cache
    (K and V of each head with its own scale), dequantized block by block in the
    kernel: q (L, H, D) ``prefill_quant_usable``; causal, counts, firsts and soft_cap as there.
    Returns out (L, H, D), written into `out` if given, and lse (L, H), float32."""
    (L, H, D), (S, row_bytes), (_, Hk, _) = q.shape, rows.shape, quant.entry_shape
    rows = rows.contiguous()
    out = attention_out(out, (L, H, D), "prefill_attention_quant")
    lse = torch.empty(L, H, dtype=torch.float32)
    sizes = (L, S, H, Hk, D, D, q.stride(0), row_bytes, Hk * D, int(causal))
    scales = (CODES[quant.codes], quant.scale_offset, 1, Hk)  # one scale per K head, then per V head
    pointers = (q.data_ptr(), rows.data_ptr())
    lib = kernels.loaded()
    ranges = (key_counts(counts, L, S), key_counts(firsts, L, S, 0))
    lib.prefill_attention_quant(
        *pointers, *sizes, *ranges, *scales, scale, soft_cap or 0.0, out.data_ptr(), lse.data_ptr()
    )
    return out, lse


def attention_out(out: torch.Tensor | None, shape: tuple[int, int, int], name: str) -> torch.Tensor:
    """``out`` checked to be what the attention kernels write, or a new one."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    if out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous float32 {shape} tensor, got {out.dtype} {tuple(out.shape)}")
    return out


def key_counts(counts: torch.Tensor | None, L: int, S: int, least: int = 1) -> int | None:
    """The address of the per-query key counts (or first keys, ``least`` 0) the prefill
    kernels read (None: none), checked: (L,) contiguous int64 on the CPU, each in [least, S]."""
    if counts is None:
        return None
    if counts.shape != (L,) or counts.dtype != torch.int64 or not counts.is_contiguous() or counts.device.type != "cpu":
        got = f"{counts.dtype} {tuple(counts.shape)} on {counts.device}"
        raise ValueError(f"key counts must be a contiguous int64 ({L},) CPU tensor, got {got}")
    if L and (int(counts.min()) < least or int(counts.max()) > S):
        raise ValueError(f"key counts must lie in [{least}, {S}], got [{int(counts.min())}, {int(counts.max())}]")
    return counts.data_ptr()
