"""Weights kept block-quantized (GGUF's Q4_0 ... Q6_K, IQ4_NL, IQ4_XS), and their projections.

A ``QuantWeight`` is the kernel's layout (kernels/quant_gemv.cpp) of a
``Decoded`` tensor (layers/quant_blocks.py): per output row, blocks of 32
weights as 4-bit nibbles (Q4_0, Q4_1, Q4_K: q in 0..15, a scale per 32) or
int8 (Q8_0, Q5_*, Q3_K, Q6_K, IQ4_*), a scale per group of 16 or 32 and an
optional offset per 32. The repacking is done once, at load. Scales and
offsets stay float16 where every one of the weight's is a half (the legacy
formats' own fp16 fields: Q4_1 reads its 5 bits a weight, 20 bytes a block),
and become float32 where not (the K-quants' and IQ4_XS's products of two
scales, int8 weights quantized at load), which holds them exactly; the 3-, 5-
and 6-bit formats widen to 8 bits, and so do IQ4_NL's and IQ4_XS's codebook
integers (-127..113). Q4_0 read from a file keeps its own form, scale * (q - 8) with q a
nibble (``zero`` 8): its scales are the file's halves, and no offsets are stored.

Q2_K's minimum is an offset per 16 weights, where the kernels take one per block
of 32 (with the block's sum of activation codes): its weight is ``spread``, each
group of 16 at the head of a block of 32 whose last 16 integers are zero, and
``quant_linear`` spreads the activations alike (each 16 followed by 16 zeros),
so that a block's offset meets its own 16 codes. The weights stay exactly the
file's; a block's activations are rounded to int8 over its 16, a finer step
than other formats' 32. Resident: a nibble a slot (1 byte a weight, half of it
zeros) and a float32 scale and offset per 16, 1.5 bytes a weight (the file's
2.625 bits; float32, 4 bytes).

A GGUF file's Q4_0, Q4_1 and Q8_0 blocks are that form already, fields
interleaved a block apart (d, [m,] q): ``QuantWeight.in_place`` takes them
where the file's memory map holds them, as strided views (the page cache's
pages, shared by every process that maps the file; nothing copied), and a
fused projection of such parts is a ``QuantParts``, each part where it lies.

On the CPU every row count takes the one integer kernel (quant_gemv.cpp):
a row's activations are rounded to int8 per block of 32 and multiplied by the
weight's integers, a decode step's one row and a prefill's thousands alike, so
a row's result never depends on how many rows share its step (docs/architecture.md, "The same bits whatever else runs").
Elsewhere (GPUs, or ``CTXPAR_KERNELS=0``) the weight is dequantized for
``F.linear``.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from ctxpar import kernels
from ctxpar.kernels import quant
from ctxpar.layers.quant_blocks import FORMATS, Decoded, decode, dequantize

# The fields of the GGUF blocks kept as they are: a half scale d, Q4_1's half minimum m,
# and the integers q (16 bytes of nibbles, or 32 int8).
BLOCK_FIELDS = {
    "Q4_0": [("d", "<f2"), ("q", "V16")],
    "Q4_1": [("d", "<f2"), ("m", "<f2"), ("q", "V16")],
    "Q8_0": [("d", "<f2"), ("q", "V32")],
}
# A GGUF's bfloat16 weights, kept as the file's bits (``MappedBlocks.bf16``) for the bf16 kernels.
BF16 = "BF16"
TILE_ROWS = 512  # weight rows dequantized at a time where the kernels do not run: 512 x 1536 floats = 3 MiB

# Allocates a weight's tensor of (shape, dtype): torch.empty's memory, or a loader's (a HugeArena's).
Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``Empty`` of memory of the weight's own."""
    return torch.empty(shape, dtype=dtype)


@dataclass
class QuantWeight:
    """An (out_features, in_features) weight: row o, weight i = scales[o, i // group] *
    (q[o, i] - zero) + offsets[o, i // 32] (0 without offsets)."""

    # (out, in * bits / 8) uint8: nibbles (bits 4) or int8 bytes (bits 8); or (out, in / 32,
    # 32 * bits / 8), blocks at any stride (a GGUF file's, between their scales)
    qs: torch.Tensor
    scales: torch.Tensor  # (out, in / group) float32, or float16 (see the module's docstring)
    offsets: torch.Tensor | None  # (out, in / 32), the scales' dtype
    bits: int  # 4 or 8
    group: int  # 16 or 32
    zero: int = 0  # 8: Q4_0's nibbles (bits 4, group 32, no offsets)
    mapped: bool = False  # views of a file's memory map: read where they lie, never copied
    spread: bool = False  # each 16 weights at the head of a block of 32 (Q2_K: see the module)
    kernel_parts: ctypes.Array = field(init=False, repr=False, compare=False)  # the kernels' view: one QuantPart

    def __post_init__(self) -> None:
        # The kernel reads these through raw pointers: their layout is checked here, once
        # (a real check, not an assert: ``python -O`` would remove that).
        rows, cols, block = self.out_features, self.kernel_in, 32 * self.bits // 8
        off = self.offsets
        q_ok = self.qs.stride(-1) == 1 and (self.qs.dim() == 2 or self.qs.shape[1:] == (cols // 32, block))
        layout_ok = (
            self.bits in (4, 8)
            and self.group in (16, 32)
            and cols % 32 == 0
            and self.qs.dtype == torch.uint8
            and q_ok
            and self.scales.dtype in (torch.float32, torch.float16)
            and self.scales.shape == (rows, cols // self.group)
            and (off is None or (off.dtype == self.scales.dtype and off.shape == (rows, cols // 32)))
            and all(t.device.type == "cpu" and min(t.stride(), default=1) > 0 for t in self.tensors())
            and (self.zero == 0 or (self.zero == 8 and self.bits == 4 and self.group == 32 and off is None))
        )
        if not layout_ok:
            shapes = [(tuple(t.shape), t.stride(), t.dtype) for t in self.tensors()]
            raise ValueError(
                f"QuantWeight: bits {self.bits}, group {self.group}, zero {self.zero} and tensors {shapes} do not match"
            )
        self.kernel_parts = (quant.QuantPart * 1)(quant.part(self.qs, self.scales, self.offsets, self.bits))

    def __setattr__(self, name: str, value: object) -> None:
        # Weights move after loading (onto huge pages, into a segment the ranks share):
        # the kernels' view follows, written where it lies (a QuantParts' array holds it).
        super().__setattr__(name, value)
        if name in ("qs", "scales", "offsets") and "kernel_parts" in self.__dict__:
            self.kernel_parts[0] = quant.part(self.qs, self.scales, self.offsets, self.bits)

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def kernel_in(self) -> int:
        """Weights a row as the kernels read it: twice ``in_features`` where ``spread``."""
        return self.qs.shape[1] * 32 if self.qs.dim() == 3 else self.qs.shape[1] * 8 // self.bits

    @property
    def in_features(self) -> int:
        return self.kernel_in // 2 if self.spread else self.kernel_in

    @property
    def half(self) -> bool:
        return self.scales.dtype == torch.float16

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        """Bytes a projection reads: what a decode step's floor counts."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.scales, self.offsets) if t is not None]

    @classmethod
    def from_decoded(cls, d: Decoded, bits: int | None = None) -> QuantWeight:
        """The kernel's layout of ``d``: 4 bits where every q is a nibble and groups are
        32 (or ``bits`` to force 8, e.g. to join a weight whose rows are 8-bit); offsets
        of exactly -8 scales (Q4_0) as ``zero`` 8, which the kernels take in integers;
        offsets per 16 (Q2_K) ``spread``."""
        if d.offset_group == 16:
            return _spread_weight(d, bits)
        rows, cols = d.q.shape
        if bits is None:
            bits = 4 if d.group == 32 and d.q.min(initial=0) >= 0 and d.q.max(initial=0) <= 15 else 8
        zero = 0
        if bits == 4 and d.offsets is not None and np.array_equal(d.offsets, np.float32(-8) * d.scales):
            d, zero = Decoded(d.q, d.scales, None, d.group), 8
        if bits == 4:
            q = d.q.astype(np.uint8).reshape(rows, cols // 32, 2, 16)  # weights i and i + 16 share byte i
            qs = (q[:, :, 0] | (q[:, :, 1] << np.uint8(4))).reshape(rows, cols // 2)
        else:
            qs = d.q.view(np.uint8)
        # Scales and offsets as halves where every one is a half (no rounding), else float32.
        fields = [f for f in (d.scales, d.offsets) if f is not None]
        halves = all(np.array_equal(f.astype(np.float16).astype(np.float32), f) for f in fields)
        as_tensor = lambda f: torch.from_numpy(np.ascontiguousarray(f.astype(np.float16 if halves else np.float32)))
        offsets = None if d.offsets is None else as_tensor(d.offsets)
        return cls(torch.from_numpy(np.ascontiguousarray(qs)), as_tensor(d.scales), offsets, bits, d.group, zero)

    @classmethod
    def in_place(cls, raw: np.ndarray, fmt: str) -> QuantWeight:
        """A GGUF tensor's blocks (``has_fields``) where they lie, raw (rows, bytes a row)
        uint8 rows of a memory map: its fields as views of the bytes, a block apart
        (kernels/quant_part.h), nothing copied."""
        rows, nbytes = raw.shape[0], FORMATS[fmt].nbytes
        with warnings.catch_warnings():  # read-only by design: the kernels never write a weight
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            blocks = torch.from_numpy(raw)
        halves = blocks.view(torch.float16)  # (rows, bytes a row / 2): d, Q4_1's m, then the q bytes
        q_at = 2 * (len(BLOCK_FIELDS[fmt]) - 1)  # q follows the block's halves
        width = nbytes - q_at
        qs = blocks.as_strided((rows, blocks.shape[1] // nbytes, width), (blocks.stride(0), nbytes, 1), q_at)
        scales = halves[:, 0 :: nbytes // 2]
        offsets = halves[:, 1 :: nbytes // 2] if fmt == "Q4_1" else None
        bits, zero = (8, 0) if fmt == "Q8_0" else (4, 8 if fmt == "Q4_0" else 0)
        return cls(qs, scales, offsets, bits, 32, zero, mapped=True)

    @classmethod
    def from_blocks(cls, raw: np.ndarray, fmt: str, cols: int) -> QuantWeight:
        """The kernel's layout of a GGUF tensor's blocks, raw (rows, cols / 32 * bytes)
        uint8 (a memory map of the file). Q4_0, Q4_1 and Q8_0 blocks already hold the
        kernel's integers (a nibble byte pairs weights i and i + 16, as here) and
        half scales: their fields are copied out as they are, one pass over the bytes
        (``from_fields``); other formats are decoded."""
        if not has_fields(fmt, cols):
            return cls.from_decoded(decode(raw, fmt, cols))
        return cls.from_fields([np.ascontiguousarray(raw)], fmt, cols, torch_empty)

    @classmethod
    def from_fields(cls, raws: list[np.ndarray], fmt: str, cols: int, empty: Empty) -> QuantWeight:
        """The kernel's layout of the rows of ``raws`` one after another, each (..., cols
        / 32 * bytes) uint8 blocks of format ``fmt`` (``has_fields``) whose leading axes,
        flattened in order, are its rows (a view of a memory map, rows permuted or not),
        in tensors ``empty`` allocates: each field of the blocks (d, Q4_1's m, q) is copied
        where it belongs as it is, so Q4_0 keeps its form, ``zero`` 8."""
        fields = np.dtype(BLOCK_FIELDS[fmt])
        blocks = cols // 32
        bits, zero = (8, 0) if fmt == "Q8_0" else (4, 8 if fmt == "Q4_0" else 0)
        rows = sum(math.prod(raw.shape[:-1]) for raw in raws)
        into = {"q": empty((rows, cols * bits // 8), torch.uint8), "d": empty((rows, blocks), torch.float16)}
        if fmt == "Q4_1":  # its blocks' minimum m
            into["m"] = empty((rows, blocks), torch.float16)
        copies, first = [], 0
        for raw in raws:
            # The blocks as records: numpy copies a field of fixed-size records at memory
            # speed, where a slice of each block's bytes goes a few bytes at a time.
            records, n = raw.view(fields), math.prod(raw.shape[:-1])
            for name, dest in into.items():
                dest_rows = dest[first : first + n].numpy().view(fields[name]).reshape(records.shape)
                copies.append((dest_rows, records[name]))
            first += n
        copy_on_threads(copies)
        return cls(into["q"], into["d"], into.get("m"), bits, 32, zero)

    def decoded(self) -> Decoded:
        """Back to ``Decoded`` (the inverse of ``from_decoded``)."""
        d = self.stored()
        if not self.spread:
            return d
        rows, slots = d.q.shape  # each block of 32 slots: a group's 16 weights, then 16 zeros
        q = np.ascontiguousarray(d.q.reshape(rows, -1, 2, 16)[:, :, 0]).reshape(rows, slots // 2)
        scales = np.ascontiguousarray(d.scales.reshape(rows, slots // 32, -1)[:, :, 0])
        return Decoded(q, scales, d.offsets, 16, offset_group=16)

    def stored(self) -> Decoded:
        """``Decoded`` of the integers, scales and offsets as stored (a ``spread`` weight's
        kernel_in slots a row)."""
        qs = self.qs.reshape(self.out_features, -1).numpy()
        if self.bits == 4:
            rows = qs.shape[0]
            nib = np.stack([qs.reshape(rows, -1, 16) & 15, qs.reshape(rows, -1, 16) >> 4], axis=2)
            q = (nib.reshape(rows, -1).astype(np.int16) - self.zero).astype(np.int8)
        else:
            q = qs.view(np.int8)
        offsets = None if self.offsets is None else self.offsets.float().numpy()
        return Decoded(q, self.scales.float().numpy(), offsets, self.group)

    def rows(self, first: int, end: int) -> QuantWeight:
        """Output rows [first, end) as views (a vocabulary range of the lm_head)."""
        off = None if self.offsets is None else self.offsets[first:end]
        return replace(self, qs=self.qs[first:end], scales=self.scales[first:end], offsets=off)

    def dequantize(self, first: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [first, end) as float32 (end - first, in)."""
        end = self.out_features if end is None else end
        if not kernels.available():
            return torch.from_numpy(dequantize(self.rows(first, end).decoded()))
        return self._floats(range(first, end))

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (n,) as float32 (n, in): a quantized embedding table's lookup."""
        if not kernels.available():
            off = None if self.offsets is None else self.offsets[ids]
            return replace(self, qs=self.qs[ids], scales=self.scales[ids], offsets=off, mapped=False).dequantize()
        return self._floats(ids)

    def _floats(self, rows: range | torch.Tensor) -> torch.Tensor:
        w = quant.quant_dequantize(
            self.kernel_parts[0], self.kernel_in, self.bits, self.group, self.half, rows, self.zero
        )
        return w.view(len(w), -1, 2, 16)[:, :, 0].reshape(len(w), -1) if self.spread else w  # (n, in)


def copy_on_threads(copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """``np.copyto(dest, src)`` of each pair, their first axis split over torch's threads
    (a rank's cores; numpy copies without the GIL): the first writes to fresh memory
    fault its pages in, which costs as much as the copy, and the cores take the faults
    side by side."""
    threads = torch.get_num_threads()

    def part(k: int) -> None:
        for dest, src in copies:
            lo, hi = len(dest) * k // threads, len(dest) * (k + 1) // threads
            np.copyto(dest[lo:hi], src[lo:hi])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, range(threads)))  # list: a thread's exception is raised here


def has_fields(fmt: str, cols: int) -> bool:
    """Whether blocks of ``fmt`` hold the kernel's layout as fields (``QuantWeight.from_fields``)."""
    return fmt in BLOCK_FIELDS and cols % 32 == 0


@dataclass(frozen=True)
class MappedBlocks:
    """A GGUF tensor's blocks where the file's memory map holds them, not yet laid out:
    ``join`` writes them once, where the weight stays (beside a fused projection's
    other parts), where laying each out first would write every byte twice."""

    raw: np.ndarray  # (..., bytes a row) uint8 of the map: leading axes, flattened in order, are the rows
    fmt: str  # its block format (layers/quant_blocks.py), or BF16
    cols: int  # weights a row
    empty: Empty  # allocates the joined weight's tensors
    release: Callable[[], None]  # drops the map's pages once copied (the page cache keeps them)

    @property
    def out_features(self) -> int:
        return math.prod(self.raw.shape[:-1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.cols)

    def placed(self) -> QuantWeight:
        """Where it lies (``QuantWeight.in_place``) if the map holds its rows in order,
        else its fields copied out (``from_fields``) and its pages released."""
        if self.raw.ndim == 2 and self.raw.flags.c_contiguous:
            return QuantWeight.in_place(self.raw, self.fmt)
        w = QuantWeight.from_fields([self.raw], self.fmt, self.cols, self.empty)
        self.release()
        return w

    def laid_out(self) -> QuantWeight:
        """Its own layout, in memory of its own (``QuantWeight.from_blocks``); its pages released."""
        w = QuantWeight.from_blocks(np.ascontiguousarray(self.raw).reshape(self.out_features, -1), self.fmt, self.cols)
        self.release()
        return w

    def bf16(self) -> torch.Tensor:
        """A BF16 tensor's rows (out, in) as the file's bfloat16 bits, in memory ``empty``
        allocates; its pages released."""
        w = self.empty(self.shape, torch.bfloat16)
        np.copyto(w.view(torch.uint8).numpy(), self.raw.reshape(self.out_features, -1))
        self.release()
        return w

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32 (where a fused weight's other rows came as floats)."""
        return self.bf16().float() if self.fmt == BF16 else self.laid_out().dequantize()


@dataclass
class QuantParts:
    """A fused projection (QKV, gate|up) whose parts stay where they lie (a GGUF file's
    blocks in its memory map): the parts' rows one after another, one kernel call
    writing each part's outputs beside the others'. The parts share their form
    (bits, group, zero, half scales)."""

    parts: list[QuantWeight]
    kernel_parts: ctypes.Array = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        first = self.parts[0]
        form = lambda w: (w.bits, w.group, w.zero, w.half, w.in_features, w.offsets is None, w.spread)  # noqa: E731
        if any(form(w) != form(first) for w in self.parts):
            raise ValueError(f"QuantParts: parts of different forms {[form(w) for w in self.parts]}")
        self.kernel_parts = (quant.QuantPart * len(self.parts))(*(w.kernel_parts[0] for w in self.parts))
        size = ctypes.sizeof(quant.QuantPart)
        for k, w in enumerate(self.parts):  # each part's view is its entry here, so that a moved part updates it
            w.kernel_parts = (quant.QuantPart * 1).from_buffer(self.kernel_parts, k * size)

    bits = property(lambda self: self.parts[0].bits)
    group = property(lambda self: self.parts[0].group)
    zero = property(lambda self: self.parts[0].zero)
    half = property(lambda self: self.parts[0].half)
    spread = property(lambda self: self.parts[0].spread)
    in_features = property(lambda self: self.parts[0].in_features)

    @property
    def out_features(self) -> int:
        return sum(w.out_features for w in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self.parts)

    def dequantize(self, first: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [first, end) as float32 (end - first, in)."""
        end = self.out_features if end is None else end
        pieces, at = [], 0
        for w in self.parts:
            lo, hi = max(first, at), min(end, at + w.out_features)
            if lo < hi:
                pieces.append(w.dequantize(lo - at, hi - at))
            at += w.out_features
        return torch.cat(pieces) if pieces else torch.empty(0, self.in_features)


Quantized = QuantWeight | QuantParts


def join(parts: list[QuantWeight | MappedBlocks]) -> Quantized | torch.Tensor:
    """The parts' rows one after another as one weight (a fused QKV or gate|up
    projection, or one part alone). Mapped parts of one format with fields
    (``has_fields``) stay where the map holds them (``QuantWeight.in_place``), a
    ``QuantParts`` where several; those whose rows the map does not hold in order
    (Q and K, un-permuted) are copied out (``from_fields``, into memory the part's
    ``empty`` allocates). Others are laid out each, then concatenated (``concat``).
    BF16 parts give a bfloat16 tensor, the file's bits (float32 where a part is not BF16)."""
    first = parts[0]
    if any(isinstance(p, MappedBlocks) and p.fmt == BF16 for p in parts):
        kept = all(isinstance(p, MappedBlocks) and p.fmt == BF16 for p in parts)
        rows = [p.bf16() if kept and isinstance(p, MappedBlocks) else p.dequantize() for p in parts]
        return rows[0] if len(rows) == 1 else torch.cat(rows)
    if isinstance(first, MappedBlocks) and has_fields(first.fmt, first.cols):
        same = [p for p in parts if isinstance(p, MappedBlocks) and (p.fmt, p.cols) == (first.fmt, first.cols)]
        if len(same) == len(parts):
            placed = [p.placed() for p in same]
            return placed[0] if len(placed) == 1 else QuantParts(placed)
    laid = [p.laid_out() if isinstance(p, MappedBlocks) else p for p in parts]
    return laid[0] if len(laid) == 1 else concat(laid)


def concat(parts: list[QuantWeight]) -> QuantWeight:
    """The weights' rows one after another (a fused QKV or gate|up projection).
    Parts of different layouts meet in the widest: spread if one is (Q2_K), 8 bits,
    the finer group, no zero unless every part has it; each weight's value is
    unchanged (a nibble is an int8, a scale repeats)."""
    if any(p.spread for p in parts):
        parts = [p if p.spread else _spread_weight(p.decoded()) for p in parts]
    zero = parts[0].zero if all(p.zero == parts[0].zero for p in parts) else 0
    bits = 8 if any(p.zero != zero for p in parts) else max(p.bits for p in parts)
    group = min(p.group for p in parts)
    widened = [_widen(p, bits, group, zero) for p in parts]
    # Halves only if every part's are (a half is exact as a float32, not the reverse).
    dtype = torch.float16 if all(p.scales.dtype == torch.float16 for p in widened) else torch.float32

    def offsets(p: QuantWeight) -> torch.Tensor:
        zeros = torch.zeros(p.out_features, p.kernel_in // 32, dtype=dtype)
        return zeros if p.offsets is None else p.offsets.to(dtype)

    joined = torch.cat([offsets(p) for p in widened]) if any(p.offsets is not None for p in widened) else None
    qs, scales = torch.cat([p.qs for p in widened]), torch.cat([p.scales.to(dtype) for p in widened])
    return QuantWeight(qs, scales, joined, bits, group, zero, spread=parts[0].spread)


def _widen(p: QuantWeight, bits: int, group: int, zero: int) -> QuantWeight:
    if p.bits == bits and p.group == group and p.zero == zero:
        return p
    d = p.stored()  # a spread weight's slots as they are: widened slot by slot
    scales = np.repeat(d.scales, d.group // group, axis=1)
    return replace(QuantWeight.from_decoded(Decoded(d.q, scales, d.offsets, group), bits), spread=p.spread)


def _spread_weight(d: Decoded, bits: int | None = None) -> QuantWeight:
    """``d``'s weights ``spread``: each group of 16 at the head of a block of 32 slots whose
    last 16 are zero, its scale and offset the block's (group 32)."""
    rows, cols = d.q.shape
    q = np.zeros((rows, cols // 16, 2, 16), np.int8)
    q[:, :, 0] = d.q.reshape(rows, -1, 16)
    per_16 = lambda f, group: np.repeat(f, group // 16, axis=1)  # noqa: E731
    offsets = None if d.offsets is None else per_16(d.offsets, d.offset_group)
    slots = Decoded(q.reshape(rows, 2 * cols), per_16(d.scales, d.group), offsets, 32)
    return replace(QuantWeight.from_decoded(slots, bits), spread=True)


def spread_activations(x: torch.Tensor) -> torch.Tensor:
    """x (n, in) as a ``spread`` weight's kernel reads it: (n, 2 in), each 16 followed by 16 zeros."""
    n, cols = x.shape
    out = x.new_zeros(n, cols // 16, 2, 16)
    out[:, :, 0] = x.reshape(n, cols // 16, 16)
    return out.view(n, 2 * cols)


def quant_linear(x: torch.Tensor, w: Quantized, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (n, in) @ w^T (+ bias) -> (n, out) in x's dtype."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.float()
    if x.device.type == "cpu" and kernels.available():
        if x.shape[1] != w.in_features:
            raise ValueError(f"quant_linear: x has {x.shape[1]} features, the weight {w.in_features}")
        xk = spread_activations(x) if w.spread else x
        out = quant.quant_linear(xk, w.kernel_parts, w.out_features, w.bits, w.group, w.half, w.zero, bias)
    else:
        out = torch.empty(x.shape[0], w.out_features, dtype=torch.float32, device=x.device)
        for first in range(0, w.out_features, TILE_ROWS):
            end = min(w.out_features, first + TILE_ROWS)
            tile_bias = None if bias is None else bias[first:end].float()
            out[:, first:end] = F.linear(x, w.dequantize(first, end).to(x.device), tile_bias)
    return out if dtype == torch.float32 else out.to(dtype)
