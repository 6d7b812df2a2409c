"""Large kernel outputs from reused buffers (ctxpar/kernels/scratch.py): a buffer comes back
only once no tensor or view shares its memory, so a live output is never overwritten."""

from __future__ import annotations

import threading

import pytest
import torch

from ctxpar.kernels import elementwise, scratch

BIG = (scratch.LARGE // 4 // 1024 + 1, 1024)  # float32 rows just past LARGE bytes


@pytest.fixture(autouse=True)
def fresh_pool() -> None:
    scratch._local.__dict__.pop("kept", None)  # this thread's buffers from earlier tests


def test_a_buffer_comes_back_only_when_nothing_holds_it() -> None:
    first = scratch.empty(BIG)
    ptr = first.data_ptr()
    view = first[3:]  # a view outlives its base
    del first
    second = scratch.empty(BIG)
    assert second.data_ptr() != ptr  # the view's memory is not handed out
    del second
    assert scratch.empty(BIG).data_ptr() != ptr
    del view
    again = scratch.empty(BIG)
    assert again.data_ptr() == ptr and again.shape == BIG and again.dtype == torch.float32
    del again
    assert scratch.empty((BIG[0] * 2, BIG[1]), torch.bfloat16).data_ptr() == ptr  # any shape and dtype it holds
    small = scratch.empty((4, 4))  # under LARGE: torch.empty's own
    assert small.shape == (4, 4) and small.dtype == torch.float32


def test_a_kept_output_is_not_overwritten_by_the_next_product() -> None:
    """silu_mul's output through the pool: the first stays as computed while the second
    is made, and both equal PyTorch's."""
    n, inter = BIG[0], BIG[1]
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, 2 * inter, generator=g) for _ in range(2))
    first = elementwise.silu_mul(a)
    kept = first.clone()
    second = elementwise.silu_mul(b)
    assert second.data_ptr() != first.data_ptr() and torch.equal(first, kept)
    for x, got in ((a, first), (b, second)):
        torch.testing.assert_close(got, torch.nn.functional.silu(x[:, :inter]) * x[:, inter:])


def test_each_thread_keeps_its_own_buffers_within_the_bounds() -> None:
    held: dict[str, list[int]] = {}

    def run(name: str) -> None:
        outs = [scratch.empty(BIG) for _ in range(scratch.KEPT + 2)]  # all alive: all distinct
        huge = scratch.empty((scratch.KEPT_BYTES // 4 + 1,))  # never kept
        held[name] = [t.data_ptr() for t in outs]
        del outs, huge
        kept = scratch._local.kept
        assert len(kept) <= scratch.KEPT and sum(b.numel() for b in kept) <= scratch.KEPT_BYTES

    threads = [threading.Thread(target=run, args=(name,)) for name in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(held["a"])) == len(held["a"]) == scratch.KEPT + 2
