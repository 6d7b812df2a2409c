"""A fused projection's GGUF blocks joined where the weight stays (layers/quant_linear.py's
``join``): byte for byte what laying each part out and concatenating them gave, written
straight into huge pages for the formats whose blocks hold the kernel's fields, each
part's mapped pages released once copied."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxpar.kernels.huge_pages import HugeArena, on_huge_pages
from ctxpar.layers.quant_linear import MappedBlocks, QuantWeight, concat, join
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
    assert_same(got, concat([QuantWeight.from_blocks(r, fmt, COLS) for r, fmt in zip(rows, formats)]))
    assert sorted(released) == [0, 1, 2]
    # One format with fields: written once, into the arena's huge pages; else laid out apart.
    direct = formats[0] in ("Q4_0", "Q4_1", "Q8_0") and len(set(formats)) == 1
    assert all(on_huge_pages(t) == direct for t in got.tensors())


def test_a_part_alone_and_a_part_laid_out() -> None:
    """One mapped part joins to its own layout; laid out, or dequantized, apart from the
    arena (a fused weight whose other rows came as floats)."""
    raw = random_blocks("Q4_0", 8, COLS, np.random.default_rng(3))
    arena = HugeArena()
    part = MappedBlocks(raw, "Q4_0", COLS, arena.empty, lambda: None)
    want = QuantWeight.from_blocks(raw, "Q4_0", COLS)
    assert_same(join([part]), want)
    assert_same(part.laid_out(), want)
    assert not any(on_huge_pages(t) for t in part.laid_out().tensors())
    assert torch.equal(part.dequantize(), want.dequantize())
    assert join([want]) is want
