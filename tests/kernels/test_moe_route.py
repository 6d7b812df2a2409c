"""kernels/moe_route.cpp against PyTorch's softmax, topk and sigmoid (the expert layer's
arithmetic before the kernel, and transformers'): the same experts, their weights within
float32 rounding; equal scores broken toward the lower id; each row's bits its own."""

from __future__ import annotations

import pytest
import torch

from ctxpar import kernels
from ctxpar.kernels import moe_route

pytestmark = pytest.mark.skipif(not kernels.available(), reason="ctxpar's kernels are not built here")


@pytest.mark.parametrize("renorm", [False, True])
def test_routing_is_softmax_top_k(renorm: bool) -> None:
    logits = torch.randn(37, 64, generator=torch.Generator().manual_seed(0)) * 3
    weights, ids = moe_route.route(logits, 8, renorm, 2.5)
    scores = logits.softmax(-1)
    want_w, want_ids = torch.topk(scores, 8, dim=-1)
    if renorm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w * 2.5, rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lower_id_and_rows_compute_alone() -> None:
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    logits[2] = 0.0  # every expert ties
    logits[3, [4, 9, 11]] = 7.0  # three tie at the top
    weights, ids = moe_route.route(logits, 3, True, 1.0)
    assert ids[2].tolist() == [0, 1, 2] and ids[3].tolist() == [4, 9, 11]
    assert torch.equal(weights[3], torch.full((3,), weights[3, 0].item()))
    for r in range(5):
        alone = moe_route.route(logits[r : r + 1], 3, True, 1.0)
        assert torch.equal(alone[0][0], weights[r]) and torch.equal(alone[1][0], ids[r])


def test_sigmoid() -> None:
    x = torch.linspace(-100, 100, 1001)
    got = moe_route.sigmoid(x)
    torch.testing.assert_close(got, torch.sigmoid(x), rtol=2e-7, atol=1e-30)
    assert all(torch.equal(moe_route.sigmoid(x[i : i + 1]), got[i : i + 1]) for i in range(0, 1001, 97))
