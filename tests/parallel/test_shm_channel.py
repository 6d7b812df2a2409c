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

from ctxpar import LLM, SamplingParams
from ctxpar.executor.multiproc import free_port
from ctxpar.parallel.shm_channel import PeerLost, ShmChannel
from helpers.procs import shm_mappings
from helpers.shm_ranks import peer_main, rank_main

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_deliver_what_each_rank_sent(size: int) -> None:
    ctx = mp.get_context("spawn")
    errors, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, size, port, errors)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in procs] == [0] * size


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
    peer = ctx.Process(target=peer_main, args=(port, behaviour))
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
