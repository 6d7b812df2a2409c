"""Run scripted step plans on P real ranks (gloo) and bring back what every
rank computed: rank 0's logits and each rank's KV cache.

One set of processes forms groups of several sizes in turn, and each group
runs many jobs (model, cp_interleave, pcp_min_tokens) one after the other,
each with a fresh ModelRunner (and KV cache) over the same process group and
the same loaded models: starting processes and loading models is what costs
time on a small machine.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctxpar.layers.step_description import slots_of
from ctxpar.parallel.dcp_shard import DCPShard
from ctxpar.worker.step_plan import StepPlan
from helpers.pcp_harness import BLOCK_SIZE, BLOCKS_PER_REQUEST

NUM_BLOCKS = BLOCKS_PER_REQUEST * 6


@dataclass(frozen=True)
class Job:
    model: str
    dcp_size: int = 1  # run_groups sets it to each group's size
    cp_interleave: int = 1
    pcp_min_tokens: int = 0
    kv_cache_dtype: str = "model"


@dataclass
class Result:
    logits: list[torch.Tensor]  # rank 0's, per step
    caches: list[list[torch.Tensor]]  # per rank, per layer
    collectives: list[dict[str, int]]  # rank 0's data-group collectives of each step, by kind


@functools.cache
def _model(model_dir: str):
    from ctxpar.models.loader import load_model

    return load_model(model_dir, torch.float32, torch.device("cpu")).model


def _runner(model_dir: str, group, job: Job):
    from ctxpar.worker.model_runner import ModelRunner
    from ctxpar.worker.options import RunnerOptions

    options = RunnerOptions(
        NUM_BLOCKS,
        BLOCK_SIZE,
        pcp_min_tokens=job.pcp_min_tokens,
        dcp_size=job.dcp_size,
        cp_interleave=job.cp_interleave,
        kv_cache_dtype=job.kv_cache_dtype,
    )
    return ModelRunner(_model(model_dir), options, torch.device("cpu"), group)


def run_single(model_dir: str, plans: list[StepPlan]) -> Result:
    """The reference: one rank in this process."""
    runner = _runner(model_dir, None, Job(model_dir, 1))
    return Result([runner.execute(p).logits.clone() for p in plans], [runner.kv_caches], [])


def _rank_main(rank: int, sizes: list[int], port: int, jobs: list[Job], plans: list[StepPlan], out: str) -> None:
    """One process: for each group size P it takes part in (rank < P), a fresh
    process group of P ranks runs every job."""
    from ctxpar.parallel.comm import Launch, PCPGroup

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    launch = Launch(secret=b"one secret for the harness's ranks", spawned=True)
    for size in sizes:
        if rank >= size:
            continue
        group = PCPGroup(rank, size, torch.device("cpu"), dist.PrefixStore(f"P{size}/", store), launch)
        try:
            for j, job in enumerate(jobs):
                runner = _runner(job.model, group, replace(job, dcp_size=size))
                logits, collectives = [], []
                for p in plans:
                    before = group.num_collectives.copy()
                    step = runner.execute(p)
                    logits.append(step.logits if step is not None else None)  # rank 0's only
                    collectives.append(dict(group.num_collectives - before))
                saved = {"logits": logits, "caches": runner.kv_caches, "collectives": collectives}
                torch.save(saved, os.path.join(out, f"{size}.{j}.{rank}.pt"))
        finally:
            group.close()


def run_groups(sizes: list[int], jobs: list[Job], plans: list[StepPlan], out_dir: Path) -> dict[int, list[Result]]:
    """Every job on groups of each size in ``sizes`` (its dcp_size set to the
    group size): {size: one Result per job}. The processes start once."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, sizes, store.port, jobs, plans, str(out_dir)))
        for r in range(max(sizes))
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * len(procs), f"rank exit codes {codes}"
    results: dict[int, list[Result]] = {}
    for size in sizes:
        results[size] = []
        for j in range(len(jobs)):
            saved = [torch.load(out_dir / f"{size}.{j}.{r}.pt") for r in range(size)]
            results[size].append(Result(saved[0]["logits"], [s["caches"] for s in saved], saved[0]["collectives"]))
    return results


def computed_positions(plans: list[StepPlan]) -> dict[int, tuple[np.ndarray, int]]:
    """{request: (block table, number of positions computed)} after all the plans.
    A request is known by its block table (pcp_harness gives each a disjoint range)."""
    done: dict[int, tuple[np.ndarray, int]] = {}
    for plan in plans:
        for table, c, q in zip(plan.block_tables, plan.num_computed_tokens, plan.num_scheduled_tokens):
            req = int(table.min()) // BLOCKS_PER_REQUEST
            done[req] = (table, max(done.get(req, (table, 0))[1], int(c + q)))
    return done


def shard_slots(plans: list[StepPlan], shard: DCPShard) -> tuple[np.ndarray, np.ndarray]:
    """(slots on ``shard``'s rank, the slots the same entries have in a one-rank cache),
    over every position the plans computed that this rank owns."""
    mine, single = [], []
    for table, length in computed_positions(plans).values():
        pos = np.arange(length)
        pos = pos[shard.owner(pos) == shard.rank]
        mine.append(slots_of(table, shard.local_position(pos), BLOCK_SIZE))
        single.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    return np.concatenate(mine), np.concatenate(single)
