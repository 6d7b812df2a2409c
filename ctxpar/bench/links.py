"""What more machines buy over a shaped link: P = 2 (or ``--pcp 2 3``) ranks on
as many "hosts" (network namespaces, each joined to a switch by a veth pair
shaped with tc tbf to 1, 10 and 100 Gbit/s, or unshaped for an RDMA-class
link), each pinned to its own core (rank k to core k mod the cores: with more
ranks than cores they share, and the speed-ups are not separate machines')
and meeting through torchrun's c10d rendezvous as on real machines, against
P = 1 on one core, measured in the same run.

The model is a random one of SmolLM2-135M's shapes with ``--layers`` layers
(yarn-stretched past 8192 tokens as `ctxpar bench long`). For each link and
prompt length: TTFT at each P (D = 1 and D = P) and its speed-up over P = 1,
decode ms/token after the prompt, the time one layer's KV all-gather takes in
the engine's prefill (waiting for the other rank included), the link's own
latency and bandwidth as gloo sees them (all-gathers timed inside the same
torchrun job), and the speed-up ``ctxpar estimate`` predicts from those.

netem is not in every kernel, so no delay is added: the veth's own latency is
measured, and the published latency of each link class is added in the
prediction only. Needs root, iproute2 and taskset; every run is bounded by
``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ctxpar.bench.links_driver import SLACK
from ctxpar.checks import int_arg, positive_int
from ctxpar.costmodel import netns
from ctxpar.costmodel.link_calibration import SMALL_BYTES, fit_link
from ctxpar.errors import CtxparError

Result = dict[str, Any]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[8192, 32768], metavar="N", help="(8192 32768)")
    p.add_argument("--links", nargs="+", choices=list(netns.LINKS), default=list(netns.LINKS), help="(all)")
    p.add_argument("--layers", type=positive_int, default=2, metavar="N", help="layers of the random model (2)")
    p.add_argument("--decode-tokens", type=positive_int, default=8, metavar="N", help="decode steps timed (8)")
    p.add_argument("--chunk", type=positive_int, default=None, metavar="N", help="max_num_batched_tokens (the longest)")
    p.add_argument("--timeout", type=positive_int, default=900, metavar="S", help="seconds per run, at most (900)")
    p.add_argument("--pcp", type=int_arg(2), nargs="+", default=[2], metavar="P", help="ranks, hosts (2)")
    p.add_argument("--no-dcp", action="store_true", help="skip D = P")


def _driver_args(model: Path, args: argparse.Namespace, pcp: int, dcp: int) -> list[str]:
    from ctxpar.bench.long import TRAINED

    factor = max(1.0, (max(args.lengths) + args.decode_tokens + SLACK) / TRAINED)  # the engine's max_model_len
    lengths = [str(n) for n in args.lengths]
    chunk = args.chunk or max(args.lengths)
    return [
        "ctxpar.bench.links_driver", "--model", str(model), "--lengths", *lengths, "--pcp", str(pcp),
        "--dcp", str(dcp), "--decode-tokens", str(args.decode_tokens), "--chunk", str(chunk),
        "--yarn-factor", str(factor),
    ]  # fmt: skip


def _parse(lines: list[str]) -> tuple[dict[int, Result], dict[str, float]]:
    """Rank 0's RESULT lines by prompt length, and its LINK line (all-gather seconds by bytes)."""
    results = {r["length"]: r for r in (json.loads(x[7:]) for x in lines if x.startswith("RESULT "))}
    links = [json.loads(x[5:]) for x in lines if x.startswith("LINK ")]
    return results, (links[0] if links else {})


def _env(**extra: str) -> dict[str, str]:
    # One thread per rank: a rank is one core; kernels build once (shared cache dir).
    return dict(os.environ, OMP_NUM_THREADS="1", CTXPAR_SHM="0", **extra)


def _run_pcp(
    hosts: tuple[netns.Host, ...], model: Path, args: argparse.Namespace, dcp: int, label: str
) -> tuple[dict[int, Result], dict[str, float]]:
    """P = len(hosts) (D = dcp): node k in host k's namespace, pinned to core k (mod the cores)."""
    cmds: list[list[str]] = []
    envs: list[dict[str, str]] = []
    rdzv_id = f"links-{os.getpid()}-{time.monotonic_ns()}"
    secret = secrets.token_hex(32)  # the job's, shared by its hosts
    pcp, cores = len(hosts), os.cpu_count() or 1
    for rank, host in enumerate(hosts):
        driver = _driver_args(model, args, pcp, dcp)
        cmds.append(netns.torchrun_command(host, rank, pcp, rank % cores, rdzv_id, driver))
        # gloo binds the veth, not the hostname's address.
        envs.append(_env(GLOO_SOCKET_IFNAME=host.device, CTXPAR_CLUSTER_SECRET=secret))
    return _parse(netns.run_job(cmds, envs, args.timeout, label))


def _predicted(
    model: Path, latency: float, bandwidth: float, link: str, n: int, pcp: int
) -> dict[tuple[int, int], float]:
    """TTFT `ctxpar estimate` predicts on the one-core CPU profile with this link's alpha-beta."""
    from ctxpar.costmodel import estimate, load_model_shape
    from ctxpar.costmodel.profiles import BUILTIN_PROFILES

    hw = replace(
        BUILTIN_PROFILES["cpu-core-gloo"],
        link_bandwidth=bandwidth,
        link_latency_s=latency + netns.PUBLISHED_LATENCY_S[link],
    )
    est = estimate(load_model_shape(str(model)), hw, n, pcp=[1, pcp])
    return {(e.pcp, e.dcp): e.ttft_s for e in est if e.algorithm in ("none", "gather")}


def _setups(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(P, D) of every run: each P with D = 1 and D = P."""
    return [(p, d) for p in sorted(set(args.pcp)) for d in ([1] if args.no_dcp else [1, p])]


def _print_tables(model: Path, args: argparse.Namespace, base: dict[int, Result], runs: dict, links: dict) -> None:
    """The link table (per link and P), then one row per link and length."""
    from ctxpar.bench.links_driver import kv_bytes_per_token

    per_token, chunk = kv_bytes_per_token(str(model)), args.chunk or max(args.lengths)
    head = f"{'link':>8} | {'stands for':<58} | {'P':>2} | {'latency (us)':>12} | {'GB/s':>6}"
    print(f"\n{head} | one layer's KV all-gather")
    for (link, p), times in links.items():
        lat, bw = fit_link(times)
        layer = ", ".join(
            f"{n}: {1e3 * times[str(-(-min(n, chunk) // p) * per_token)]:.1f} ms" for n in sorted(args.lengths)
        )
        print(f"{link:>8} | {netns.LINKS[link][1]:<58} | {p:>2} | {1e6 * lat:>12.0f} | {bw / 1e9:>6.3f} | {layer}")
    setups, pcps = _setups(args), sorted(set(args.pcp))
    head = " | ".join(f"{f'P={p} D={d} (s)':>12} | {'x':>5} | {'model x':>7}" for p, d in setups)
    waits = " | ".join(f"{f'P={p} layer ms':>13} | {'comm':>5}" for p in pcps)
    decodes_head = f"decode ms/token P=1 / {' / '.join(f'P={p} D={d}' for p, d in setups)}"
    print(f"\n{'link':>8} | {'prompt':>6} | {'P=1 (s)':>8} | {head} | {waits} | {decodes_head} | same tokens")
    for link in args.links:
        for n in sorted(args.lengths):
            one = base[n]
            pred = {p: _predicted(model, *fit_link(links[link, p]), link, n, p) for p in pcps}
            cols, decodes, same = [], [f"{one['decode_ms']:.1f}"], []
            for p, d in setups:
                r = runs[link, p, d][n]
                model_x = pred[p][1, 1] / pred[p][p, d]
                cols.append(f"{r['ttft_s']:>12.2f} | {one['ttft_s'] / r['ttft_s']:>4.2f}x | {model_x:>6.2f}x")
                decodes.append(f"{r['decode_ms']:.1f}")
                same.append("yes" if r["tokens"] == one["tokens"] else "NO")
            wait = []
            for p in pcps:  # one KV all-gather of the prefill at D = 1, and the collectives' share of TTFT
                r = runs[link, p, 1][n]
                wait.append(f"{1e3 * r['prefill_comm_s'] / max(r['prefill_all_gathers'], 1):>13.1f} | ")
                wait[-1] += f"{r['prefill_comm_s'] / r['ttft_s']:>5.0%}"
            print(
                f"{link:>8} | {n:>6} | {one['ttft_s']:>8.2f} | {' | '.join(cols)} | {' | '.join(wait)} | "
                f"{' / '.join(decodes):>{len(decodes_head)}} | {' '.join(same)}"
            )


def run(args: argparse.Namespace) -> None:
    from ctxpar.bench.long import save_smollm2_shaped
    from ctxpar.bench.machine_line import describe_machine

    netns.check_tools()
    cores, most = os.cpu_count() or 1, max(args.pcp)
    if cores < 2:
        raise CtxparError("two cores are needed at least: one per rank")
    print(describe_machine(), flush=True)
    if most > cores:
        print(f"note: P={most} on {cores} cores: ranks share cores, which separate machines would not", flush=True)
    chunk = args.chunk or max(args.lengths)
    print(
        f"{args.layers}-layer random model of SmolLM2's shapes (fp32), prompts {args.lengths}, "
        f"chunks of {chunk} tokens, {args.decode_tokens} decode steps; one thread per rank",
        flush=True,
    )
    # The namespaces first: where they cannot be made, say so before minutes of P = 1.
    with tempfile.TemporaryDirectory(prefix="ctxpar-links-") as tmp, netns.linked_hosts(most) as hosts:
        model = save_smollm2_shaped(Path(tmp), args.layers)
        t0 = time.monotonic()
        print("P=1 on core 0 ...", flush=True)
        cmd = ["taskset", "-c", "0", sys.executable, "-m", *_driver_args(model, args, 1, 1)]
        base, _ = _parse(netns.run_job([cmd], [_env()], args.timeout, "P=1"))
        print("  [P=1] TTFT " + ", ".join(f"{n}: {r['ttft_s']:.2f} s" for n, r in sorted(base.items())), flush=True)
        runs: dict[tuple[str, int, int], dict[int, Result]] = {}
        links: dict[tuple[str, int], dict[str, float]] = {}
        for link in args.links:
            netns.shape(hosts, link)
            for pcp, dcp in _setups(args):
                label = f"{link}, P={pcp} D={dcp}"
                print(f"{label} ({time.monotonic() - t0:.0f} s so far) ...", flush=True)
                runs[link, pcp, dcp], measured = _run_pcp(hosts[:pcp], model, args, dcp, label)
                links.setdefault((link, pcp), measured)
                done = ", ".join(
                    f"{n}: {r['ttft_s']:.2f} s ({base[n]['ttft_s'] / r['ttft_s']:.2f}x)"
                    for n, r in sorted(runs[link, pcp, dcp].items())
                )
                print(f"  [{label}] TTFT {done}", flush=True)
        _print_tables(model, args, base, runs, links)
    print(
        f"\nx: P=1 TTFT / P TTFT (measured); model x: what `ctxpar estimate` predicts (cpu-core-gloo compute, "
        f"the link's measured latency + its class's published latency, measured GB/s). layer ms: one KV "
        f"all-gather in the engine's prefill at D=1, waiting for the slowest rank included (the link alone: the "
        f"first table); comm: the prefill's collectives' share of TTFT. "
        f"Measure message sizes: {SMALL_BYTES} B and one layer's KV per rank."
    )
