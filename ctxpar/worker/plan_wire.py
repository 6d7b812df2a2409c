"""Rank 0's messages on the wire: data, never code.

What crosses ranks on the control path is a StepPlan, a KVCopy or the stop
(None). Each is encoded as a small JSON header naming its kind and its arrays
(field, dtype, shape), then the arrays' raw bytes, each at an 8-byte aligned
offset::

    b"CTXPAR-MSG1" | header length (u32) | header (JSON) | pad | array 0 | pad | array 1 ...

The decoder builds nothing but numpy arrays (views of the received buffer, no
copy), a torch tensor of the mtp layer's hidden states and the dataclass that
holds them; it accepts only the fields each kind has, each with its dtype and
number of dimensions, and checks that the sizes add up before it reads a byte.
So even a message whose tag checks (under ``CTXPAR_INSECURE_CLUSTER=1`` anyone
can tag one) cannot run code on a rank: the worst it can do is steer the step
(whose KV slots the model runner bounds first) or stop the rank.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ctxpar.worker.step_plan import KVCopy, StepPlan

MAGIC = b"CTXPAR-MSG1"
MAX_HEADER_BYTES = 1 << 16
ALIGN = 8

Message = StepPlan | KVCopy | None

_NUMPY = {"int64": np.dtype(np.int64), "bool": np.dtype(np.bool_)}
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class _Field:
    dtypes: tuple[str, ...]
    ndim: int
    optional: bool = False


# StepPlan's fields, its block tables as one flat array and each row's length.
_PLAN = {
    "input_ids": _Field(("int64",), 1),
    "num_scheduled_tokens": _Field(("int64",), 1),
    "num_computed_tokens": _Field(("int64",), 1),
    "is_prefilling": _Field(("bool",), 1),
    "needs_logits": _Field(("bool",), 1),
    "block_table_lens": _Field(("int64",), 1),
    "block_table_ids": _Field(("int64",), 1),
    "all_logits": _Field(("bool",), 1, optional=True),
    "hidden_rows": _Field(("bool",), 1, optional=True),
    "num_prompt_tokens": _Field(("int64",), 1, optional=True),
    "hidden_states": _Field(tuple(_TORCH), 2, optional=True),
}
_KV_COPY = {"block_ids": _Field(("int64",), 1)}
_KINDS: dict[str, dict[str, _Field]] = {"stop": {}, "plan": _PLAN, "kv_copy": _KV_COPY}
# The (R,) arrays besides num_scheduled_tokens.
_ROW_FIELDS: tuple[str, ...] = ("num_computed_tokens", "is_prefilling", "needs_logits", "block_table_lens")
_ROW_FIELDS += ("all_logits", "hidden_rows", "num_prompt_tokens")


class MalformedMessage(RuntimeError):
    """Bytes on the ranks' control path that are not a message of rank 0's wire
    format: the rank refuses them, having run nothing they say."""


def _pad(n: int) -> int:
    return -n % ALIGN


def encode(msg: Message) -> bytes:
    """``msg`` as bytes of the wire format (rank 0)."""
    arrays: dict[str, np.ndarray | torch.Tensor] = {}
    draft = False
    if msg is None:
        kind = "stop"
    elif isinstance(msg, KVCopy):
        kind = "kv_copy"
        arrays["block_ids"] = np.asarray(msg.block_ids, dtype=np.int64)
    elif isinstance(msg, StepPlan):
        kind, draft = "plan", msg.draft
        for name in ("input_ids", "num_scheduled_tokens", "num_computed_tokens", "num_prompt_tokens"):
            if getattr(msg, name) is not None:
                arrays[name] = np.asarray(getattr(msg, name), dtype=np.int64)
        for name in ("is_prefilling", "needs_logits", "all_logits", "hidden_rows"):
            if getattr(msg, name) is not None:
                arrays[name] = np.asarray(getattr(msg, name), dtype=np.bool_)
        arrays["block_table_lens"] = np.fromiter((len(t) for t in msg.block_tables), np.int64, len(msg.block_tables))
        ids = [np.asarray(t, dtype=np.int64) for t in msg.block_tables]
        arrays["block_table_ids"] = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        if msg.hidden_states is not None:
            arrays["hidden_states"] = msg.hidden_states.detach().to("cpu").contiguous()
    else:
        raise TypeError(f"rank 0 sends StepPlan, KVCopy or None, not {type(msg).__name__}")
    entries, raw = [], []
    for name, a in arrays.items():
        dtype = str(a.dtype).removeprefix("torch.")
        entries.append([name, dtype, list(a.shape)])
        raw.append(a.view(torch.uint8).numpy() if isinstance(a, torch.Tensor) else a)
    header = json.dumps({"kind": kind, "draft": draft, "arrays": entries}, separators=(",", ":")).encode()
    offset = len(MAGIC) + 4 + len(header)
    offsets = []
    for a in raw:
        offset += _pad(offset)
        offsets.append(offset)
        offset += a.nbytes
    out = bytearray(offset)
    out[: len(MAGIC) + 4 + len(header)] = MAGIC + struct.pack("<I", len(header)) + header
    for a, at in zip(raw, offsets):
        np.frombuffer(out, np.uint8, a.nbytes, at)[:] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return bytes(out)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in ``data`` (a worker); its arrays are views of ``data``. Raises
    MalformedMessage naming the problem for anything else."""
    try:
        return _decode(memoryview(data).cast("B"))
    except MalformedMessage as e:
        raise MalformedMessage(
            f"a message from rank 0 is not one of ctxpar's wire format ({e}): refused, nothing in it was run"
        ) from None


def _decode(buf: memoryview) -> Message:
    if buf.readonly:  # the arrays are views of it, writable as a plan's arrays are on rank 0
        buf = memoryview(bytearray(buf))
    start = len(MAGIC) + 4
    if len(buf) < start or bytes(buf[: len(MAGIC)]) != MAGIC:
        raise MalformedMessage("it does not start with the wire format's magic bytes (is it a pickle?)")
    (n,) = struct.unpack("<I", buf[len(MAGIC) : start])
    if n > MAX_HEADER_BYTES or start + n > len(buf):
        raise MalformedMessage(f"its header claims {n} bytes, more than the limit or the message")
    try:
        header = json.loads(bytes(buf[start : start + n]))
        kind, draft, entries = header["kind"], header["draft"], header["arrays"]
    except (ValueError, KeyError, TypeError):
        raise MalformedMessage("its header is not the JSON object of the wire format") from None
    if kind not in _KINDS or not isinstance(draft, bool) or not isinstance(entries, list):
        raise MalformedMessage(f"its header names no known kind of message ({str(kind)[:40]!r})")
    arrays = _arrays(buf, start + n, _KINDS[kind], entries)
    try:
        return _build(kind, draft, arrays)
    except (ValueError, TypeError) as e:
        raise MalformedMessage(f"its {kind} is inconsistent: {e}") from None


def _arrays(buf: memoryview, offset: int, fields: dict[str, _Field], entries: list) -> dict[str, Any]:
    """The arrays the header lists, as views of buf, once each is checked against ``fields``."""
    arrays: dict[str, Any] = {}
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], list)):
            raise MalformedMessage("an array's entry in its header is not [name, dtype, shape]")
        name, dtype, shape = entry
        field = fields.get(name) if isinstance(name, str) else None
        if field is None or name in arrays:
            raise MalformedMessage(f"its header lists an unknown or repeated array {str(name)[:40]!r}")
        if dtype not in field.dtypes or len(shape) != field.ndim:
            raise MalformedMessage(f"its array {name!r} is not {'/'.join(field.dtypes)} of {field.ndim} dimension(s)")
        if not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
            raise MalformedMessage(f"its array {name!r} has an invalid shape")
        offset += _pad(offset)
        count = math.prod(shape)
        itemsize = _NUMPY[dtype].itemsize if dtype in _NUMPY else _TORCH[dtype].itemsize
        if offset + count * itemsize > len(buf):
            raise MalformedMessage(f"its array {name!r} runs past the end of the message")
        if dtype in _NUMPY:
            arrays[name] = a = np.frombuffer(buf, _NUMPY[dtype], count, offset).reshape(shape)
            if dtype == "bool" and a.view(np.uint8).max(initial=0) > 1:
                raise MalformedMessage(f"its array {name!r} holds bytes other than 0 and 1")
        elif count == 0:  # torch.frombuffer takes no empty range
            arrays[name] = torch.empty(shape, dtype=_TORCH[dtype])
        else:
            arrays[name] = torch.frombuffer(buf, dtype=_TORCH[dtype], count=count, offset=offset).view(shape)
        offset += count * itemsize
    if offset != len(buf):
        raise MalformedMessage(f"it has {len(buf) - offset} bytes past its last array")
    missing = [name for name, field in fields.items() if not field.optional and name not in arrays]
    if missing:
        raise MalformedMessage(f"it lacks the array(s) {missing}")
    return arrays


def _build(kind: str, draft: bool, arrays: dict[str, Any]) -> Message:
    if kind == "stop":
        return None
    if kind == "kv_copy":
        return KVCopy(arrays["block_ids"])
    rows = len(arrays["num_scheduled_tokens"])
    for name in _ROW_FIELDS:
        if name in arrays and len(arrays[name]) != rows:
            raise ValueError(f"{name} has {len(arrays[name])} rows, num_scheduled_tokens {rows}")
    lens = arrays.pop("block_table_lens")
    ids = arrays.pop("block_table_ids")
    if lens.min(initial=0) < 0 or int(lens.sum()) != len(ids):
        raise ValueError("the block tables' lengths do not add up to their block ids")
    hidden = arrays.get("hidden_states")
    if hidden is not None and hidden.shape[0] != len(arrays["input_ids"]):
        raise ValueError("hidden_states has a row count other than input_ids'")
    ends = np.cumsum(lens).tolist()
    tables = [ids[a:b] for a, b in zip([0, *ends[:-1]], ends)]  # views: a slice each (np.split is slower)
    return StepPlan(**arrays, block_tables=tables, draft=draft)
