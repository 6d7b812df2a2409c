"""`ctxpar calibrate --link 1gbit|10gbit|100gbit|rdma`: the cost of a gloo
all-gather between two "hosts" joined by a shaped link.

The link is `ctxpar bench links`' (ctxpar/bench/netns.py): two network
namespaces, each joined to a switch (a bridge) by a veth pair shaped with tc
tbf, so the bytes cross the kernel's TCP stack and the shapers as they would
cross NICs. One process in each
namespace (this module, run with ``python -m``) times all-gathers over it at a
few message sizes (``links_driver.measure_link``); rank 0 prints the times, and
their alpha-beta fit (``links_driver.fit_link``) becomes the profile's link
latency and bandwidth. The whole measurement is bounded by ``timeout_s``; the
processes are killed and the namespaces removed whatever happens. Needs root
and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ctxpar.bench import netns
from ctxpar.bench.links_driver import measure_link
from ctxpar.errors import RankFailure

# Bytes per rank besides links_driver's small one (the latency): all past the tbf bucket
# of 1 and 10 Gbit/s (125 KB, 1.25 MB), so the slope is the shaped rate; 64 MiB takes
# ~0.5 s at 1 Gbit/s.
SIZES = (4 << 20, 16 << 20, 64 << 20)
TIMEOUT_S = 180  # python and torch start in each namespace, then a few seconds of transfers
MODULE = "ctxpar.bench.calibrate_link"  # run in each namespace (as __main__, so spelled out)


def measure_shaped_link(link: str, timeout_s: float = TIMEOUT_S) -> dict[str, float]:
    """Seconds of a 2-rank gloo all-gather over ``link`` (a key of netns.LINKS), by
    bytes per rank (as strings: links_driver's format)."""
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
