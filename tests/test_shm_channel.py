"""The shared-memory collectives of ranks on one host (ctxpar/parallel/shm_channel.py),
between real processes: every collective delivers what each rank sent (data
larger than a slot in several rounds, slots reused across collectives), a
dead rank fails the others' collective within a second, a silent one after
the timeout, and no file stays behind in /dev/shm; a /dev/shm too small for
the weights leaves each rank its own copy."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_collectives import shm_mappings

from ctxpar import LLM, SamplingParams
from ctxpar.executor.multiproc import free_port
from ctxpar.parallel.shm_channel import PeerLost, ShmChannel

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

SLOT = 96  # bytes: most collectives below need several rounds


def sent(rank: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """What `rank` sends in collective `step`: computable by every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + rank))


def shapes(step: int) -> tuple[int, ...]:
    return ((0, 3), (1, 2), (5, 7), (40, 3), (2, 2, 9))[step % 5]


def _ranks(rank: int, size: int, port: int, errors) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=30))
        ch = ShmChannel(store, rank, size, timeout_s=30, slot_bytes=SLOT)
        for step in range(15):
            shape = shapes(step)
            everyone = [sent(k, step, shape) for k in range(size)]
            kind = step % 3
            if kind == 0:
                assert torch.equal(ch.all_gather(everyone[rank]), torch.cat(everyone))
            elif kind == 1:
                got = ch.gather_to_first(everyone[rank])
                assert (got is None) == (rank != 0)
                assert rank != 0 or torch.equal(got, torch.stack(everyone))
            else:  # all_to_all: (P, m, ...) per rank, row k of the result is rank k's row `rank`
                blocks = [sent(k, step, (size, *shape)) for k in range(size)]
                assert torch.equal(ch.all_to_all(blocks[rank]), torch.stack([b[rank] for b in blocks]))
    except BaseException as e:  # reported to the test, which asserts none
        errors.put(f"rank {rank}: {e!r}")
        raise


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_deliver_what_each_rank_sent(size: int) -> None:
    ctx = mp.get_context("spawn")
    errors, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_ranks, args=(r, size, port, errors)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in procs] == [0] * size


def _peer(port: int, behaviour: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    ShmChannel(store, 1, 2, timeout_s=30)
    if behaviour == "silent":
        time.sleep(30)
    os._exit(0)  # "dies": leaves without taking part in the next collective


@pytest.mark.parametrize(
    "behaviour,timeout_s,words,within_s",
    [
        ("dies", 30, "PCP rank 1 is gone", 2.0),
        ("silent", 1, "silent for 1 s", 3.0),
    ],
)
def test_a_dead_or_silent_peer_fails_the_collective(behaviour, timeout_s, words, within_s) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    peer = ctx.Process(target=_peer, args=(port, behaviour))
    peer.start()
    try:
        ch = ShmChannel(store, 0, 2, timeout_s=timeout_s)
        leftovers = [f for f in os.listdir("/dev/shm") if f.startswith(f"ctxpar-{os.getpid()}-")]
        assert leftovers == []  # unlinked once every rank mapped it
        start = time.monotonic()
        with pytest.raises(PeerLost, match=words):
            ch.all_gather(torch.zeros(4))
        assert time.monotonic() - start < within_s
    finally:
        peer.kill()
        peer.join()


def test_a_small_dev_shm_leaves_each_rank_its_weights(tiny_model_dirs, monkeypatch):
    """With no room in /dev/shm for the weights (docker's default 64 MiB against a
    real model), rank 0 warns and every rank keeps its own copy; the collectives
    still go through the pages, and the tokens are one rank's."""
    from ctxpar.executor import shared_weights

    path, prompt = str(tiny_model_dirs["llama"]), [{"prompt_token_ids": list(range(60))}]
    with LLM(path) as one:
        want = one.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(shared_weights, "free_bytes", lambda: 0)
    with pytest.warns(UserWarning, match="too little for one shared copy of the weights"):
        llm = LLM(path, pcp_size=2, num_threads=1)
    with llm:
        [worker] = llm.engine.executor.procs
        assert llm.engine.executor.group.shm is not None
        assert len(set(shm_mappings(os.getpid())) & set(shm_mappings(worker.pid))) == 1  # the channel's only
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
