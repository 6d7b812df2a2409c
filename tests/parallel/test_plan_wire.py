"""Rank 0's messages on the wire (ctxpar/worker/plan_wire.py): a plan decodes to the
plan that was encoded, field for field, dtype for dtype, over random plans; and
bytes that are not a message of the format (a pickle, a truncated or inflated
message, a header that lies about its arrays) are refused with the reason,
before anything in them is used."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.worker.plan_wire import MAGIC, MalformedMessage, decode, encode
from ctxpar.worker.step_plan import KVCopy, StepPlan


def _same(a: object, b: object) -> bool:
    """Equal values of equal types: arrays by dtype, shape and elements, tensors by their bits."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, torch.Tensor):
        bits = torch.uint8
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _same_plan(a: StepPlan, b: StepPlan) -> bool:
    return all(_same(getattr(a, f), getattr(b, f)) for f in StepPlan.__dataclass_fields__)


@st.composite
def plans(draw: st.DrawFn) -> StepPlan:
    rows = draw(st.integers(1, 8))
    q = np.array(draw(st.lists(st.integers(1, 6), min_size=rows, max_size=rows)), dtype=np.int64)
    ints = st.integers(0, 2**40)
    flags = st.lists(st.booleans(), min_size=rows, max_size=rows)

    def optional_flags() -> np.ndarray | None:
        return np.array(draw(flags), dtype=bool) if draw(st.booleans()) else None

    hidden = None
    if draw(st.booleans()):
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        hidden = torch.randn(int(q.sum()), draw(st.integers(0, 5)), generator=gen).to(dtype)
    return StepPlan(
        input_ids=np.array(draw(st.lists(ints, min_size=int(q.sum()), max_size=int(q.sum()))), dtype=np.int64),
        num_scheduled_tokens=q,
        num_computed_tokens=np.array(draw(st.lists(ints, min_size=rows, max_size=rows)), dtype=np.int64),
        is_prefilling=np.array(draw(flags), dtype=bool),
        needs_logits=np.array(draw(flags), dtype=bool),
        block_tables=[np.array(draw(st.lists(ints, max_size=5)), dtype=np.int64) for _ in range(rows)],
        all_logits=optional_flags(),
        draft=draw(st.booleans()),
        hidden_rows=optional_flags(),
        hidden_states=hidden,
        num_prompt_tokens=np.array(draw(st.lists(ints, min_size=rows, max_size=rows)), dtype=np.int64)
        if draw(st.booleans())
        else None,
    )


@settings(max_examples=300, deadline=None)
@given(plans())
def test_a_plan_decodes_to_the_plan_encoded(plan):
    decoded = decode(encode(plan))
    assert isinstance(decoded, StepPlan) and _same_plan(decoded, plan)
    assert decoded.input_ids.flags.writeable  # as the arrays of a plan built on rank 0


def test_kv_copies_and_the_stop_decode_to_themselves():
    copy = decode(encode(KVCopy(np.array([7, 3, 9], dtype=np.int64))))
    assert isinstance(copy, KVCopy) and _same(copy.block_ids, np.array([7, 3, 9], dtype=np.int64))
    assert decode(encode(None)) is None


def _plan() -> StepPlan:
    return StepPlan(
        input_ids=np.arange(3, dtype=np.int64),
        num_scheduled_tokens=np.array([2, 1], dtype=np.int64),
        num_computed_tokens=np.array([0, 5], dtype=np.int64),
        is_prefilling=np.array([True, False]),
        needs_logits=np.array([True, True]),
        block_tables=[np.array([1], dtype=np.int64), np.array([2, 3], dtype=np.int64)],
    )


def _message(header: dict, body: bytes) -> bytes:
    """A message of the format with this header (JSON) and these array bytes after it."""
    head = json.dumps(header).encode()
    start = len(MAGIC) + 4 + len(head)
    return MAGIC + struct.pack("<I", len(head)) + head + bytes(-start % 8) + body


def _with_header(edit) -> bytes:
    """The test plan's message with its header changed by edit(header)."""
    data = encode(_plan())
    (n,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
    header = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + n])
    start = len(MAGIC) + 4 + n
    body = data[start + (-start % 8) :]
    edit(header)
    return _message(header, body)


def _rename(name: str, to: str):
    def edit(header: dict) -> None:
        for entry in header["arrays"]:
            if entry[0] == name:
                entry[0] = to

    return edit


def _retype(name: str, dtype: str):
    def edit(header: dict) -> None:
        for entry in header["arrays"]:
            if entry[0] == name:
                entry[1] = dtype

    return edit


def _reshape(name: str, shape: list):
    def edit(header: dict) -> None:
        for entry in header["arrays"]:
            if entry[0] == name:
                entry[2] = shape

    return edit


@pytest.mark.parametrize(
    "data,why",
    [
        (pickle.dumps(_plan()), "magic bytes"),
        (encode(_plan())[:-8], "runs past the end"),
        (encode(_plan()) + bytes(8), "bytes past its last array"),
        (MAGIC + struct.pack("<I", 1 << 30), "header claims"),
        (_message({"kind": "os.system", "draft": False, "arrays": []}, b""), "no known kind"),
        (_with_header(_rename("input_ids", "__reduce__")), "unknown or repeated array"),
        (_with_header(_retype("input_ids", "object")), "is not int64"),
        (_with_header(_reshape("input_ids", [3, 1])), "of 1 dimension"),
        (_with_header(_reshape("block_table_ids", [2**39])), "runs past the end"),
        (_with_header(_reshape("block_table_ids", [-1])), "invalid shape"),
        (_with_header(lambda h: h["arrays"].pop(0)), "bytes past its last array"),
        (encode(_plan()).replace(b"\x01\x01", b"\x02\x01"), "bytes other than 0 and 1"),
    ],
)
def test_what_is_not_a_message_is_refused_with_the_reason(data, why):
    with pytest.raises(MalformedMessage, match="not one of ctxpar's wire format") as refused:
        decode(data)
    assert why in str(refused.value)


def test_a_plan_whose_arrays_disagree_is_refused():
    """Each array well formed, together inconsistent: rows, block tables, tokens."""
    with pytest.raises(MalformedMessage, match="needs_logits has 1 rows, num_scheduled_tokens 2"):
        decode(_with_header(_reshape("needs_logits", [1])))
    plan = _plan()
    uneven = encode(StepPlan(**{**plan.__dict__, "block_tables": [np.zeros(0, np.int64), np.arange(3)]}))
    assert isinstance(decode(uneven), StepPlan)
    lens_at = uneven.index(np.array([0, 3], dtype=np.int64).tobytes())
    lying = uneven[:lens_at] + np.array([1, 3], dtype=np.int64).tobytes() + uneven[lens_at + 16 :]
    with pytest.raises(MalformedMessage, match="block tables' lengths do not add up"):
        decode(lying)
