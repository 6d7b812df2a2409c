"""A fused projection's GGUF blocks placed (layers/quant_linear.py's ``join``): for the
formats whose blocks hold the kernel's fields, parts the file holds in order stay in its
map and the kernels read them there, a permuted part (Q, K) is copied out un-permuted
onto huge pages and its mapped pages released; other formats are laid out and
concatenated. Either way, the weights of laying each part out and concatenating them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxpar.kernels.huge_pages import HugeArena, on_huge_pages
from ctxpar.layers.quant_linear import MappedBlocks, QuantParts, QuantWeight, concat, join
from ctxpar.models.gguf import unpermute, unpermuted_rows
from tests.helpers.gguf_blocks import random_blocks

COLS = 512
HEADS = 4  # of the permuted part: rows a multiple of 2 * HEADS


def parts_of(formats: list[str], rng: np.random.Generator) -> list[np.ndarray]:
    """Random blocks of 16, 8 and 8 rows (a QKV projection's), one part per format."""
    return [random_blocks(fmt, rows, COLS, rng) for fmt, rows in zip(formats, (16, 8, 8))]


def assert_same(got: QuantWeight, want: QuantWeight) -> None:
    assert (got.bits, got.group, got.zero) == (want.bits, want.group, want.zero)
    assert len(got.tensors()) == len(want.tensors())
    for a, b in zip(got.tensors(), want.tensors()):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def lies_in(t: torch.Tensor, raw: np.ndarray) -> bool:
    """Whether every byte the view t reaches is one of raw's."""
    first = raw.ctypes.data
    last = t.data_ptr() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * t.element_size()
    return first <= t.data_ptr() and last < first + raw.nbytes


@pytest.mark.parametrize(
    "formats",
    [["Q4_0"] * 3, ["Q4_1"] * 3, ["Q8_0"] * 3, ["Q4_K"] * 3, ["Q4_K", "Q4_K", "Q6_K"], ["Q4_0", "Q4_0", "Q8_0"]],
)
def test_join_is_the_concat_of_each_part_laid_out(formats: list[str]) -> None:
    """The first part's rows un-permuted as the loader does for Q (a view of the blocks),
    as ``unpermute``'s copy of them would be laid out."""
    raws = parts_of(formats, np.random.default_rng(len(formats[0]) + len(set(formats))))
    views = [unpermuted_rows(raws[0], HEADS), *raws[1:]]
    released: list[int] = []
    arena = HugeArena()
    mapped = [
        MappedBlocks(v, fmt, COLS, arena.empty, lambda i=i: released.append(i))
        for i, (v, fmt) in enumerate(zip(views, formats))
    ]
    assert [p.shape for p in mapped] == [(16, COLS), (8, COLS), (8, COLS)]
    got = join(list(mapped))
    rows = [unpermute(raws[0], HEADS), *raws[1:]]
    want = concat([QuantWeight.from_blocks(r, fmt, COLS) for r, fmt in zip(rows, formats)])
    assert got.shape == want.shape and (got.bits, got.group, got.zero) == (want.bits, want.group, want.zero)
    assert torch.equal(got.dequantize(), want.dequantize())
    if formats[0] in ("Q4_0", "Q4_1", "Q8_0") and len(set(formats)) == 1:
        assert isinstance(got, QuantParts)
        copied, *placed = got.parts
        assert released == [0] and not copied.mapped and all(on_huge_pages(t) for t in copied.tensors())
        for w, raw in zip(placed, raws[1:]):  # in the map: the kernels read the file's bytes
            assert w.mapped and all(lies_in(t, raw) for t in w.tensors())
    else:
        assert isinstance(got, QuantWeight)
        assert_same(got, want)
        assert sorted(released) == [0, 1, 2]
        assert not any(on_huge_pages(t) for t in got.tensors())


def test_a_part_alone_and_a_part_laid_out() -> None:
    """One mapped part stays where it lies, its weights its own layout's; laid out, or
    dequantized, apart from the arena (a fused weight whose other rows came as floats)."""
    raw = random_blocks("Q4_0", 8, COLS, np.random.default_rng(3))
    arena = HugeArena()
    part = MappedBlocks(raw, "Q4_0", COLS, arena.empty, lambda: None)
    want = QuantWeight.from_blocks(raw, "Q4_0", COLS)
    alone = join([part])
    assert isinstance(alone, QuantWeight) and alone.mapped and all(lies_in(t, raw) for t in alone.tensors())
    assert torch.equal(alone.dequantize(), want.dequantize())
    assert_same(part.laid_out(), want)
    assert not any(on_huge_pages(t) for t in part.laid_out().tensors())
    assert torch.equal(part.dequantize(), want.dequantize())
    assert join([want]) is want
