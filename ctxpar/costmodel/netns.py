"""Several "hosts" on one machine: network namespaces, each joined to a switch
(a bridge in one more namespace) by a veth pair whose bandwidth is shaped with
``tc ... tbf`` in both directions, as a NIC's; and torchrun started inside each.

Each namespace has its own network stack (interfaces, addresses, sockets), so
ranks in them meet and exchange data only over the veth links and the bridge,
through the kernel's TCP stack, exactly as across machines; ``ip netns exec``
also gives each a mount namespace of its own, so ctxpar sees separate hosts and
uses gloo and private weights rather than the shared-memory channel.

Needs root and iproute2. Everything made here carries this process's pid in
its name and is removed on exit from ``linked_hosts`` (deleting a namespace
deletes its ends of the veth pairs, and with them the pairs).
"""

from __future__ import annotations

import collections
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ctxpar.errors import CtxparError, RankFailure

SUBNET = "10.204.0"  # private; exists only inside the namespaces made here
RDZV_PORT = 29620  # inside the namespaces: nothing else listens there

# Link profiles: tbf rate (None: the veth unshaped) and what each stands for.
LINKS: dict[str, tuple[str | None, str]] = {
    "1gbit": ("1gbit", "1 Gbit/s Ethernet"),
    "10gbit": ("10gbit", "10 Gbit/s Ethernet"),
    "100gbit": ("100gbit", "100 Gbit/s Ethernet"),
    # An RDMA NIC (200-400 Gbit/s, ~2 us) is faster than anything a veth can carry:
    # TCP over veth is bounded by the copies one core makes, a few GB/s. So "rdma" is
    # the veth unshaped, the fastest link this machine can give two namespaces.
    "rdma": (None, "RDMA-class (veth unshaped: as fast as the kernel copies)"),
}
# Published one-way latencies of each link class (switch + NIC + stack, small message):
# what netem would add on a kernel that has it; here they only enter the cost model.
PUBLISHED_LATENCY_S = {"1gbit": 50e-6, "10gbit": 20e-6, "100gbit": 10e-6, "rdma": 2e-6}


@dataclass(frozen=True)
class Host:
    namespace: str
    device: str  # its end of its veth pair (its NIC)
    address: str
    switch: str  # the switch's namespace
    port: str  # the switch's end of the host's veth pair


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise CtxparError(f"`ip {' '.join(args)}` failed: {r.stderr.strip() or r.returncode}")


def check_tools() -> None:
    """A clear error (no traceback) where namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise CtxparError("network namespaces and tc need root: run as root (or in CI, which runs as root)")
    missing = [t for t in ("ip", "tc", "taskset") if shutil.which(t) is None]
    if missing:
        raise CtxparError(f"{', '.join(missing)} not found: install iproute2 (ip, tc) and util-linux (taskset)")


@contextmanager
def linked_hosts(count: int = 2) -> Iterator[tuple[Host, ...]]:
    """``count`` namespaces, 10.204.0.1, .2, ..., each joined by a veth pair to one
    bridge in a namespace of its own (the switch); all removed afterwards."""
    check_tools()
    tag = str(os.getpid())
    switch = f"ctxpar-links-{tag}-switch"
    hosts = tuple(
        Host(f"ctxpar-links-{tag}-{i}", f"clk{tag}{i}", f"{SUBNET}.{i + 1}", switch, f"cls{tag}{i}")
        for i in range(count)
    )
    made: list[str] = []
    try:
        for ns in (switch, *(h.namespace for h in hosts)):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for h in hosts:
            # Both ends made inside their namespaces: none is ever left in this one.
            _ip("link", "add", h.device, "netns", h.namespace, "type", "veth", "peer", "name", h.port, "netns", switch)
            _ip("-n", switch, "link", "set", h.port, "master", "br0", "up")
            _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.device)
            _ip("-n", h.namespace, "link", "set", h.device, "up")
            _ip("-n", h.namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def shape(hosts: tuple[Host, ...], link: str) -> None:
    """Shape every host's link in both directions (the egress of each end of its veth
    pair) to ``link``'s rate: what a host sends, and what the switch sends it."""
    rate = LINKS[link][0]
    for namespace, device in [end for h in hosts for end in ((h.namespace, h.device), (h.switch, h.port))]:
        tc = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
        if rate is None:
            subprocess.run([*tc, "del", "dev", device, "root"], capture_output=True, timeout=30)
            continue
        # The bucket holds 1 ms at the rate (at least 64 KiB, a GSO packet), so a
        # collective's burst is not let through at the veth's own speed; the queue
        # holds 50 ms, enough that TCP is paced by the rate rather than by drops.
        bits = _rate_bits(rate)
        burst = max(64 << 10, int(bits / 8 * 1e-3))
        r = subprocess.run(
            [*tc, "replace", "dev", device, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            raise CtxparError(f"tc tbf on {device} failed: {r.stderr.strip()} (is sch_tbf in this kernel?)")


def _rate_bits(rate: str) -> float:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for suffix, scale in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise ValueError(rate)


def torchrun_command(
    host: Host, node_rank: int, nnodes: int, cpu: int, rdzv_id: str, module_args: list[str]
) -> list[str]:
    """Node ``node_rank`` of ``nnodes`` in ``host``'s namespace, pinned to core ``cpu``,
    meeting the others through torchrun's c10d rendezvous hosted on node 0."""
    return [
        "ip", "netns", "exec", host.namespace, "taskset", "-c", str(cpu),
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{SUBNET}.1:{RDZV_PORT}", "--rdzv-id", rdzv_id,
        # Node 0 hosts the rendezvous store: said outright, since torchrun's guess (the
        # endpoint is one of this host's names or addresses) misses a namespace's address.
        "--rdzv-conf", f"is_host={int(node_rank == 0)}",
        "--node-rank", str(node_rank), "--local-addr", host.address, "--max-restarts", "0",
        "-m", *module_args,
    ]  # fmt: skip


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants, pid first (torchrun starts its workers in sessions
    of their own), from every process's parent in /proc."""
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                kids[int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])].append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    tree, todo = [], [pid]
    while todo:
        tree.append(p := todo.pop())
        todo += kids.get(p, [])
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL pid and its descendants (collected first: a dead parent's children are reparented)."""
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reader(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_job(
    cmds: list[list[str]], envs: list[dict[str, str]], timeout: float, label: str, flag: str = "--timeout"
) -> list[str]:
    """Start the processes (the first one prints), echo its progress, and return its
    output lines; every process (tree) is killed if the job fails or overruns
    ``timeout`` seconds (the command's ``flag`` sets it)."""
    logs = [tempfile.TemporaryFile("w+") for _ in cmds]
    procs: list[subprocess.Popen[str]] = []
    out: list[str] = []
    try:
        for i, (cmd, env, log) in enumerate(zip(cmds, envs, logs)):
            stdout = subprocess.PIPE if i == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, env=env, stdout=stdout, stderr=log, text=True, start_new_session=True))
        lines: queue.Queue[str | None] = queue.Queue()
        assert procs[0].stdout is not None
        threading.Thread(target=_reader, args=(procs[0].stdout, lines), daemon=True).start()
        deadline = time.monotonic() + timeout
        while (line := lines.get(timeout=max(deadline - time.monotonic(), 0.01))) is not None:
            out.append(line)
            if line.startswith("PROGRESS "):
                print(f"  [{label}] {json.loads(line[9:])}", flush=True)
        for p in procs:
            p.wait(max(deadline - time.monotonic(), 1))
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            i, code = failed[0]
            logs[i].seek(0)
            tail = logs[i].read()[-2000:]
            raise RankFailure(f"{label}: process {i} exited {code}; its stderr ends:\n{tail}")
        return out
    except (queue.Empty, subprocess.TimeoutExpired):
        raise RankFailure(f"{label}: did not finish within {flag} {timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait(30)
        for log in logs:
            log.close()
