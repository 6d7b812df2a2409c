"""CUDA graphs' CPU-testable parts (ctxpar/worker/cuda_graphs.py, graph_runner.py):
sizes and buckets, padding, the memory bound, the static buffers, the slot table,
and the static forward a graph captures, run here on the CPU without ctxpar's kernels
against the engine's own eager decode step. Capture and replay need a GPU: they are
checked by `python -m ctxpar.bench.cuda_graph_check`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxpar.layers.attention.torch_ops import concat_slots, padded_slot_table
from ctxpar.worker.cuda_graphs import (
    MAX_CAPTURE_BATCH,
    CapturePlan,
    DecodeShape,
    StaticBuffers,
    bucket,
    capture_sizes,
    key_buckets,
    slot_table,
)

CPU = torch.device("cpu")
SHAPE = DecodeShape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, act_bytes=4)


@pytest.mark.parametrize("max_batch", [1, 3, 8, 13, 64, 1000])
def test_capture_sizes_cover_every_batch_with_little_padding(max_batch: int) -> None:
    sizes = capture_sizes(max_batch)
    top = min(max_batch, MAX_CAPTURE_BATCH)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == top
    for rows in range(1, top + 1):
        padded = bucket(rows, sizes)
        assert padded is not None and rows <= padded < rows + 8  # never more than 7 padding rows
    assert bucket(top + 1, sizes) is None


@pytest.mark.parametrize("max_len, block", [(100, 16), (256, 16), (300, 16), (8192, 16), (131072, 64)])
def test_key_buckets_double_up_to_the_longest_context(max_len: int, block: int) -> None:
    buckets = key_buckets(max_len, block)
    assert buckets[-1] >= max_len and buckets[-1] % block == 0 and buckets[-1] - max_len < block
    assert all(b2 == 2 * b1 for b1, b2 in zip(buckets[:-2], buckets[1:-1]))  # powers of two, then the top
    for keys in range(1, max_len + 1, 37):
        fit = bucket(keys, buckets)
        assert fit is not None and keys <= fit and (fit == buckets[0] or fit < 2 * keys or fit == buckets[-1])


def test_graph_bytes_by_hand_and_the_plan() -> None:
    """2 rows, 8 keys: states 2 x (3 x 64 + 128 + 3 x 128 + 64) = 1536, K and V 2 x 2 x 2 x 8 x 16
    = 1024, scores 2 x 2 x 4 x 8 = 128 values of 4 bytes, and 2 x 8 int64 slots."""
    assert SHAPE.graph_bytes(2, 8) == (1536 + 1024 + 128) * 4 + 8 * 16
    plan = CapturePlan(capture_sizes(16), key_buckets(1000, 16), SHAPE)
    assert plan.graphs[0] == (16, 1008) and plan.graphs == sorted(plan.graphs, reverse=True)
    assert plan.memory_bound == max(SHAPE.graph_bytes(b, k) for b, k in plan.graphs)
    assert plan.fit(3, 300) == (4, 512) and plan.fit(17, 10) is None and plan.fit(1, 1009) is None


def _slots(table: np.ndarray, positions: np.ndarray, block: int) -> np.ndarray:
    return table[positions // block] * block + positions % block


def test_buffers_pad_with_row_zero_and_hold_each_rows_write_slot() -> None:
    block = 4
    tables = [np.array([7, 2, 9]), np.array([3]), np.array([5, 1])]
    computed = np.array([9, 2, 5])
    buf = StaticBuffers(8, 6, CPU)
    buf.fill(np.array([11, 12, 13]), computed, tables, block, 4)
    pad = [0, 1, 2, 0]
    assert buf.ids[:4].tolist() == [11, 12, 13, 11] and buf.positions[:4].tolist() == computed[pad].tolist()
    assert buf.seq_lens[:4].tolist() == (computed[pad] + 1).tolist()
    expected = [int(_slots(tables[r], np.array([computed[r]]), block)[0]) for r in pad]
    assert buf.write_slots[:4].tolist() == expected
    assert buf.block_tables[3, :3].tolist() == [7, 2, 9]
    with pytest.raises(ValueError):
        buf.fill(np.array([1, 2, 3]), computed, tables, block, 2)  # more rows than the graph


def test_slot_table_matches_the_eager_paths_padded_table() -> None:
    """The graph's table, from block tables and lengths, against the eager path's
    (layers/attention/torch_ops.py), built from each row's slots: equal where the eager
    one has columns, and the last slot repeated up to the bucket."""
    block, keys = 4, 16
    tables = torch.tensor([[7, 2, 9, 0], [3, 0, 0, 0], [5, 1, 6, 8]])
    lengths = torch.tensor([10, 3, 13])
    rows = [torch.from_numpy(_slots(tables[r].numpy(), np.arange(int(n)), block)) for r, n in enumerate(lengths)]
    eager, eager_lengths = padded_slot_table(*concat_slots(rows))
    static = slot_table(tables, lengths, keys, block)
    assert static.shape == (3, keys) and torch.equal(eager_lengths, lengths)
    assert torch.equal(static[:, : eager.shape[1]], eager)
    for r, n in enumerate(lengths.tolist()):
        assert (static[r, n:] == rows[r][-1]).all()


def test_static_forward_is_the_eager_decode_step(tmp_path, monkeypatch) -> None:
    """The forward a graph captures, run on the CPU (ctxpar's kernels off, as on a GPU),
    against the runner's eager decode step of the same three rows: the same logits
    within fp32 rounding (the attention's key count differs: a bucket against each
    row's length), the KV written only at the rows' slots, the padding row's too."""
    from transformers import LlamaConfig

    from ctxpar.models.loader import load_model
    from ctxpar.worker.graph_runner import static_decode_forward
    from ctxpar.worker.model_runner import ModelRunner
    from ctxpar.worker.options import RunnerOptions
    from ctxpar.worker.step_plan import StepPlan
    from helpers.models import TINY_COMMON, save_tiny_model

    monkeypatch.setenv("CTXPAR_KERNELS", "0")
    path = save_tiny_model(LlamaConfig(**TINY_COMMON, tie_word_embeddings=False), tmp_path / "m")
    model = load_model(str(path), torch.float32, CPU).model
    block = 16
    runner = ModelRunner(model, RunnerOptions(32, block, enforce_eager=True), CPU)
    assert runner.graphs is None  # the CPU never builds graphs
    rng = np.random.default_rng(0)
    lens = [5, 40, 17]
    tables = [np.arange(4 * r, 4 * r + 4) for r in range(3)]
    prompts = [rng.integers(0, 256, n) for n in lens]

    def plan(ids, q, c, prefill) -> StepPlan:
        rows = len(q)
        return StepPlan(
            input_ids=np.concatenate(ids).astype(np.int64),
            num_scheduled_tokens=np.array(q),
            num_computed_tokens=np.array(c),
            is_prefilling=np.full(rows, prefill),
            needs_logits=np.ones(rows, bool),
            block_tables=tables,
        )

    runner.execute(plan(prompts, lens, [0, 0, 0], True))
    new = [np.array([int(rng.integers(0, 256))]) for _ in lens]
    before = runner.kv_stack.clone()
    eager = runner.execute(plan(new, [1, 1, 1], lens, False))
    after_eager = runner.kv_stack.clone()
    runner.kv_stack.copy_(before)
    buf = StaticBuffers(4, 4, CPU)
    buf.fill(np.concatenate(new), np.array(lens), tables, block, 4)  # padded to 4 rows
    hidden = static_decode_forward(model, runner.kv_caches, None, buf, torch.arange(4), 4, 64, block)
    logits = model.compute_logits(hidden[:3])
    assert eager is not None and torch.allclose(logits, eager.logits, atol=1e-4, rtol=1e-4)
    written = {int(_slots(tables[r], np.array([lens[r]]), block)[0]) for r in range(3)}
    untouched = [s for s in range(runner.kv_stack.shape[1]) if s not in written]
    assert torch.equal(runner.kv_stack[:, untouched], before[:, untouched])
    assert torch.allclose(runner.kv_stack, after_eager, atol=1e-5)
