"""Weights and KV caches on memory advised huge (ctxpar/kernels/huge_pages.py).

What the OS says about the mapping is read back from /proc/self/smaps, not
from ctxpar: the advice (VmFlags "hg"), and the huge pages actually given
where the kernel's transparent huge pages are on ("always" or "madvise").
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ctxpar.kernels import huge_pages
from ctxpar.kernels.huge_pages import HUGE_PAGE, FaultIn, HugeArena, huge_empty, huge_zeros, on_huge_pages
from ctxpar.layers.linear import shared_tensors
from ctxpar.layers.weight_arena import place_on_huge_pages
from ctxpar.models.loader import load_model
from ctxpar.worker.kv_cache_allocation import allocate_kv_caches

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = start <= address < end
            fields["range"] = head
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    assert "VmFlags" in fields, f"no mapping holds {address:#x}"
    return fields


def thp_on() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def huge_kib(t: torch.Tensor) -> int:
    return int(mapping_of(t.data_ptr())["AnonHugePages"].split()[0])


def test_huge_empty_is_zeroed_aligned_and_advised():
    t = huge_empty(3 * HUGE_PAGE + 5)
    assert t.shape == (3 * HUGE_PAGE + 5,) and t.dtype == torch.uint8
    assert t.data_ptr() % HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    t.fill_(7)  # the first touch: the pages are made now
    assert "hg" in mapping_of(t.data_ptr())["VmFlags"].split()
    if thp_on():
        assert huge_kib(t) >= 3 * HUGE_PAGE // 1024  # the three whole 2 MiB pages at least
    small = huge_empty(4096)  # below one huge page: ordinary memory
    assert small.shape == (4096,) and int(small.count_nonzero()) == 0


def test_huge_zeros_views_as_the_dtype():
    t = huge_zeros((1024, 2, 3, 64), torch.float32)
    assert t.shape == (1024, 2, 3, 64) and t.is_contiguous() and t.dtype == torch.float32
    t[5, 1, 2] = torch.arange(64.0)  # writes land where a plain tensor's would
    assert torch.equal(t[5, 1, 2], torch.arange(64.0)) and float(t.sum()) == float(torch.arange(64.0).sum())


def test_an_arena_carves_aligned_tensors_out_of_huge_pages(monkeypatch: pytest.MonkeyPatch):
    """Tensors one after another on cache lines of one advised mapping; one larger than
    a chunk gets a buffer of its own; ``on_huge_pages`` knows them, and not others."""
    monkeypatch.setattr(huge_pages, "ARENA_CHUNK", 2 * HUGE_PAGE)
    arena = HugeArena()
    a = arena.empty((3, 5), torch.float16)
    b = arena.empty((7,), torch.uint8)
    c = arena.empty((HUGE_PAGE + 1,), torch.float32)
    assert a.shape == (3, 5) and a.dtype == torch.float16 and b.shape == (7,) and c.dtype == torch.float32
    assert all(t.data_ptr() % 64 == 0 and int(t.count_nonzero()) == 0 for t in (a, b, c))
    assert b.data_ptr() == a.data_ptr() + 64  # the next cache line after a's 30 bytes
    # c starts a buffer of its own (on a huge page's boundary), past the first one's two huge pages.
    assert c.data_ptr() % HUGE_PAGE == 0 and abs(c.data_ptr() - a.data_ptr()) >= 2 * HUGE_PAGE
    assert all("hg" in mapping_of(t.data_ptr())["VmFlags"].split() for t in (a, c))
    a.copy_(torch.arange(15.0).view(3, 5))
    b.fill_(9)
    assert torch.equal(a, torch.arange(15.0, dtype=torch.float16).view(3, 5)) and int(b.sum()) == 63
    assert all(on_huge_pages(t) for t in (a, b, c, a[1:], huge_zeros((1024, 1024), torch.float32)))
    assert not on_huge_pages(torch.zeros(1 << 20)) and not on_huge_pages(huge_empty(4096))


def test_kv_caches_are_advised_huge():
    caches = allocate_kv_caches(2, 4096, (2, 3, 64), torch.float32, torch.device("cpu"))
    for c in caches:
        assert c.shape == (4096, 2, 3, 64) and int(c.count_nonzero()) == 0
        assert "hg" in mapping_of(c.data_ptr())["VmFlags"].split()


def rss_kib(t: torch.Tensor) -> int:
    return int(mapping_of(t.data_ptr())["Rss"].split()[0])


def made_pages(fault_in: FaultIn) -> None:
    """Wait until the fault-in thread has made what it was asked for."""
    deadline = time.monotonic() + 60
    while fault_in.made < fault_in.wanted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fault_in.made >= fault_in.wanted, "the fault-in thread did not make its pages"


def test_a_cache_is_faulted_in_ahead_of_the_steps_with_its_bytes_kept():
    """The thread makes the pages the steps are about to reach, ``ahead`` beyond, not the
    whole cache; bytes written before and while it runs stay as they were written (the
    advice never writes)."""
    t = huge_zeros((4, 8 * HUGE_PAGE), torch.uint8)  # 4 layers of 8 huge pages, 1-byte rows
    t[1, :100] = torch.arange(100, dtype=torch.uint8)  # a step that ran before
    assert rss_kib(t) < 2 * HUGE_PAGE // 1024  # untouched pages are not made yet
    fault_in = FaultIn.of(t, 4, 4 * HUGE_PAGE)  # a huge page of each layer ahead
    assert fault_in is not None
    t[3, 5:50] = 9  # a step that runs meanwhile
    made_pages(fault_in)
    assert 4 * HUGE_PAGE // 1024 <= rss_kib(t) < 8 * HUGE_PAGE // 1024  # the first page of each layer only
    fault_in.advance(2 * HUGE_PAGE)  # the steps reached two pages' rows of every layer: three made
    made_pages(fault_in)
    assert 12 * HUGE_PAGE // 1024 <= rss_kib(t) < 16 * HUGE_PAGE // 1024
    fault_in.advance(100 * HUGE_PAGE)  # past the end: the whole cache, no further
    made_pages(fault_in)
    assert rss_kib(t) >= 32 * HUGE_PAGE // 1024
    want = torch.zeros(4, 8 * HUGE_PAGE, dtype=torch.uint8)
    want[1, :100] = torch.arange(100, dtype=torch.uint8)
    want[3, 5:50] = 9
    assert torch.equal(t, want)


def test_the_fault_in_thread_lets_its_cache_go():
    """An engine that closes frees its cache at once, not once every page is made: the
    thread holds the cache only while the kernel works on one page."""
    t = huge_zeros((2, 512 * HUGE_PAGE), torch.uint8)  # 2 GiB: seconds to make whole
    raw = t.untyped_storage().data_ptr()
    fault_in = FaultIn.of(t, 2, 4 * 512 * HUGE_PAGE)
    assert fault_in is not None
    del t
    deadline = time.monotonic() + 1.0
    while raw in huge_pages._LIVE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert raw not in huge_pages._LIVE  # unmapped
    fault_in.thread.join(timeout=60)
    assert not fault_in.thread.is_alive()
    assert FaultIn.of(torch.zeros(4, 8), 4, HUGE_PAGE) is None  # not huge_empty's memory: left alone


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    from tests.helpers.models import TINY_COMMON, save_tiny_model

    # Wide enough that its weights exceed one huge page (~2.6 MB in fp32).
    config = LlamaConfig(**{**TINY_COMMON, "hidden_size": 256, "intermediate_size": 512}, tie_word_embeddings=False)
    return save_tiny_model(config, tmp_path_factory.mktemp("huge") / "m")


def test_weights_move_to_huge_pages_unchanged(model_dir):
    model = load_model(str(model_dir), torch.float32, torch.device("cpu")).model
    before = [getattr(h, a).clone() for h, a in shared_tensors(model)]
    place_on_huge_pages(model)
    after = [getattr(h, a) for h, a in shared_tensors(model)]
    assert len(after) == len(before) > 1
    for b, a in zip(before, after):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    # One advised buffer holds them all, each on a cache line of its own.
    mappings = [mapping_of(a.data_ptr()) for a in after]
    assert {m["range"] for m in mappings} == {mappings[0]["range"]}
    assert "hg" in mappings[0]["VmFlags"].split()
    assert all(a.data_ptr() % 64 == 0 for a in after)


def test_weights_on_huge_pages_already_stay_where_they_are(model_dir):
    """A weight a loader wrote on huge pages is not copied again; the others move."""
    model = load_model(str(model_dir), torch.float32, torch.device("cpu")).model
    holders = shared_tensors(model)
    holder, attr = holders[0]
    w = getattr(holder, attr)
    placed = HugeArena().empty(tuple(w.shape), w.dtype).copy_(w)  # as a GGUF's loader writes its blocks
    setattr(holder, attr, placed)
    place_on_huge_pages(model)
    assert getattr(holder, attr).data_ptr() == placed.data_ptr()
    assert all(on_huge_pages(getattr(h, a)) for h, a in holders)


def test_an_engine_keeps_its_weights_and_caches_on_huge_pages(model_dir):
    from ctxpar import LLM

    with LLM(
        str(model_dir), dtype="float32", max_model_len=64, kv_cache_bytes=1 << 23, skip_tokenizer_init=True
    ) as llm:
        holder, attr = shared_tensors(llm.engine.loaded.model)[0]
        assert "hg" in mapping_of(getattr(holder, attr).data_ptr())["VmFlags"].split()
        cache = llm.engine.executor.runner.target.kv_caches[0]
        assert "hg" in mapping_of(cache.data_ptr())["VmFlags"].split()


def test_an_engines_steps_advance_its_kv_fault_in(model_dir):
    """The model runner tells the thread how far its steps' block tables reach."""
    from ctxpar import LLM, SamplingParams

    # The default 1 GiB cache: more than KV_AHEAD, so the thread is asked for part of it.
    with LLM(str(model_dir), dtype="float32", max_model_len=64, block_size=16) as llm:
        runner = llm.engine.executor.runner.target
        fault_in = runner.fault_in
        assert fault_in is not None and fault_in.wanted == fault_in.ahead  # before any step
        llm.generate([{"prompt_token_ids": list(range(1, 40))}], SamplingParams(max_tokens=2), use_tqdm=False)
        # Blocks 0-2 (40 slots of 16): three blocks' rows reached in every layer.
        assert fault_in.wanted == min(fault_in.part, 3 * 16 * fault_in.row_bytes + fault_in.ahead)
