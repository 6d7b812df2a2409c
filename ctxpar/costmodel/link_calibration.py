"""The cost of a gloo all-gather between ranks: timed at a few message sizes
(``measure_link``, every rank) and fitted to a latency and a bandwidth
(``fit_link``). ``ctxpar calibrate`` fits its local ranks' all-gathers so, and
`ctxpar bench links` its ranks' over the link they run on.

`ctxpar calibrate --link 1gbit|10gbit|100gbit|rdma` measures two "hosts"
joined by a shaped link (``measure_shaped_link``): two network namespaces, each
joined to a switch (a bridge) by a veth pair shaped with tc tbf
(ctxpar/costmodel/netns.py, as `ctxpar bench links`), so the bytes cross the
kernel's TCP stack and the shapers as they would cross NICs. One process in
each namespace (this module, run with ``python -m``) times all-gathers over it;
rank 0 prints the times, and their fit becomes the profile's link latency and
bandwidth. The whole measurement is bounded by ``timeout_s``; the processes are
killed and the namespaces removed whatever happens. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from ctxpar.costmodel import netns
from ctxpar.errors import RankFailure

SMALL_BYTES = 4 << 10  # an all-gather this small costs the link's latency alone
# Bytes per rank besides the small one (the latency): all past the tbf bucket
# of 1 and 10 Gbit/s (125 KB, 1.25 MB), so the slope is the shaped rate; 64 MiB takes
# ~0.5 s at 1 Gbit/s.
SIZES = (4 << 20, 16 << 20, 64 << 20)
TIMEOUT_S = 180  # python and torch start in each namespace, then a few seconds of transfers
MODULE = "ctxpar.costmodel.link_calibration"  # run in each namespace (as __main__, so spelled out)


def best_of(fn: Callable[[], object], runs: int) -> float:
    """Fastest of exactly ``runs`` calls (after one warm-up call): collectives need the
    same count on every rank."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_link(step_bytes: list[int], world: int) -> dict[str, float]:
    """Every rank: gloo all-gather times over the link, best of a few, per message size
    (bytes per rank, as strings), SMALL_BYTES among them; the default process group
    (env://, as torchrun sets it) is formed here and destroyed again so that an engine
    can form its own afterwards."""
    import torch
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    times: dict[str, float] = {}
    try:
        for size in sorted({SMALL_BYTES, *step_bytes}):
            x = torch.zeros(size // 4)
            out = torch.empty(world * x.numel())
            times[str(size)] = best_of(lambda: gather(out, x), 20 if size <= 1 << 20 else 3)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return times


def fit_link(times: dict[str, float]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of all-gathers timed at two or more sizes, by bytes
    per rank (each rank receives one message of each other rank): the smallest
    message's time is the latency (it costs nothing else); the bandwidth is the
    inverse slope of a least-squares line of time against bytes through every size."""
    import numpy as np

    sizes = sorted(times, key=int)
    x, y = np.array([int(s) for s in sizes], dtype=float), np.array([times[s] for s in sizes])
    slope = float(np.polyfit(x, y, 1)[0])
    return times[sizes[0]], 1 / max(slope, 1e-15)


def measure_shaped_link(link: str, timeout_s: float = TIMEOUT_S) -> dict[str, float]:
    """Seconds of a 2-rank gloo all-gather over ``link`` (a key of netns.LINKS), by
    bytes per rank (as strings: ``measure_link``'s format)."""
    with netns.linked_hosts() as hosts:
        netns.shape(hosts, link)
        cmds, envs = [], []
        for rank, host in enumerate(hosts):
            cmds.append(
                ["ip", "netns", "exec", host.namespace, sys.executable, "-m", MODULE]
                + ["--sizes", *(str(s) for s in SIZES)]
            )
            # torch.distributed's env:// rendezvous, hosted by rank 0 in its namespace; gloo
            # binds the veth (not the hostname's address, which is not in the namespace).
            env = dict(MASTER_ADDR=hosts[0].address, MASTER_PORT=str(netns.RDZV_PORT), RANK=str(rank))
            envs.append(dict(os.environ, **env, WORLD_SIZE="2", GLOO_SOCKET_IFNAME=host.device, OMP_NUM_THREADS="1"))
        lines = netns.run_job(cmds, envs, timeout_s, f"all-gather over {link}", "--link-timeout")
    found = [json.loads(x[5:]) for x in lines if x.startswith("LINK ")]
    if not found:
        raise RankFailure(f"all-gather over {link}: rank 0 printed no timings")
    return found[0]


def main(argv: list[str] | None = None) -> None:
    """One rank: time the all-gathers (rank 0 prints them as a ``LINK`` line of JSON)."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    p.add_argument("--sizes", type=int, nargs="+", required=True, help="bytes per rank")
    times = measure_link(p.parse_args(argv).sizes, 2)
    if os.environ["RANK"] == "0":
        print(f"LINK {json.dumps(times)}", flush=True)


if __name__ == "__main__":
    main()
