"""`ctxpar calibrate`'s collectives between two ranks: a 2-rank all-gather timed
for a small message (alpha: the latency) and a large one (beta: bytes/s), over
gloo and over ctxpar's shared-memory channel between two spawned local
processes, or over gloo across a shaped link between two network namespaces
(ctxpar/costmodel/link_calibration.py)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctxpar.costmodel.link_calibration import best_of, fit_link, measure_shaped_link

SMALL, LARGE = 4 << 10, 16 << 20  # all-gather message per rank
RUNS = {SMALL: 50, LARGE: 8}
# torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor (as parallel/comm.py).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, port: int, results: dict[str, float]) -> None:
    """Rank ``rank`` of 2: time all-gathers of SMALL and LARGE bytes per rank."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    timings: dict[str, float] = {}
    for size in (SMALL, LARGE):
        x = torch.zeros(size // 4)
        out = torch.empty(2 * x.numel())
        timings[f"gloo_{size}"] = best_of(lambda: _all_gather(out, x), RUNS[size])
    try:
        from ctxpar.parallel.shm_channel import ShmChannel

        shm = ShmChannel(store, rank, 2, timeout_s=30.0)
        for size in (SMALL, LARGE):
            x = torch.zeros(size // 4)
            timings[f"shm_{size}"] = best_of(lambda: shm.all_gather(x), RUNS[size])
    except Exception as e:  # no compiler, /dev/shm too small: gloo's figures still stand
        timings["shm_error"] = float("nan")
        print(f"  shared-memory channel unavailable: {e}", flush=True)
    dist.barrier()
    if rank == 0:
        results.update(timings)
    dist.destroy_process_group()


def collective_costs() -> dict[str, float]:
    """alpha (s) and beta (bytes/s) of a 2-rank all-gather, for gloo and shm."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_collective_worker, args=(_free_port(), results), nprocs=2, join=True)
        t = dict(results)
    costs: dict[str, float] = {}
    for link in ("gloo", "shm"):
        if f"{link}_{LARGE}" in t:
            times = {str(size): t[f"{link}_{size}"] for size in (SMALL, LARGE)}
            costs[f"{link}_latency_s"], costs[f"{link}_bandwidth"] = fit_link(times)
    return costs


def shaped_link_costs(link: str, timeout_s: float) -> dict[str, float]:
    """alpha (s) and beta (bytes/s) of a 2-rank gloo all-gather over a shaped ``link``
    between two network namespaces, and its times by bytes per rank (for the record)."""
    times = measure_shaped_link(link, timeout_s)
    latency, bandwidth = fit_link(times)
    costs = {f"{link}_latency_s": latency, f"{link}_bandwidth": bandwidth}
    return costs | {f"{link}_allgather_{size}_s": t for size, t in times.items()}
