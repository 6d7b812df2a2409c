"""A soak of the HTTP server: random request mixes and random client aborts
against a live `ctxpar serve` for --duration seconds (default 30 minutes).

C client threads (--concurrency) each send one random request after another
(soak_clients.py: completions and chat, streamed or not, sampled or greedy,
n = 1 or 2, logprobs; --abort-rate of them leave early, --bad-rate are bad
requests that must get a 400). With --kill-rank-every S (P >= 2), a random
rank other than rank 0 is SIGKILLed every S seconds: the server must recover
it with no request lost (/health's counts are checked at the end). Every --report-every seconds a line gives
requests served, aborted and refused, errors, and the server's RSS (rank 0,
and all its processes). At the end: requests served, errors by kind, latency
p50 / p99 of the served ones, RSS at the start (after a warm-up) and at the
end once idle, and whether the KV cache is wholly free again (/metrics:
nothing running or waiting, usage 0). The exit status is 1 if any request
got an answer other than the one expected, or the cache is not free.

Traffic goes to loopback only (a server started here on a free port, or --url).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from ctxpar.bench.soak_clients import Outcome, plan, send
from ctxpar.checks import fraction, int_arg, max_threads, nonnegative_int, positive_int
from ctxpar.costmodel.netns import process_tree

EXPECTED = {"ok", "left", "refused"}  # every other outcome kind is an error


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--model", metavar="PATH", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--url", metavar="URL", help="a running loopback server (default: start one here)")
    p.add_argument("--pcp", type=positive_int, default=1, metavar="P", help="PCP ranks of the server (default: 1)")
    p.add_argument("--threads", type=int_arg(1, max_threads()), metavar="N", help="torch threads per rank")
    p.add_argument("--duration", type=positive_int, default=1800, metavar="S", help="seconds (default: 1800)")
    p.add_argument("--concurrency", type=positive_int, default=16, metavar="C", help="client threads (default: 16)")
    p.add_argument("--max-tokens", type=positive_int, default=64, metavar="N", help="most tokens asked (default: 64)")
    p.add_argument(
        "--max-prompt-words", type=positive_int, default=300, metavar="N", help="longest prompt (default: 300)"
    )
    p.add_argument("--abort-rate", type=fraction, default=0.1, metavar="F", help="clients that leave early (0.1)")
    p.add_argument("--bad-rate", type=fraction, default=0.05, metavar="F", help="bad requests (0.05)")
    p.add_argument("--report-every", type=positive_int, default=30, metavar="S", help="seconds per line (30)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the mix (default: 0)")
    p.add_argument(
        "--kill-rank-every",
        type=positive_int,
        metavar="S",
        help="SIGKILL a random PCP rank (not rank 0) every S seconds; the server recovers it (needs --pcp >= 2)",
    )


def rss_mb(pid: int) -> float:
    """Resident memory of one process, MiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def rank_pids(server_pid: int) -> list[int]:
    """The server's spawned PCP ranks (rank 0 is the server process itself)."""
    ranks = []
    for pid in process_tree(server_pid)[1:]:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
        except OSError:
            continue  # gone meanwhile
    return ranks


def kill_ranks(server_pid: int, every: float, stop: float, rng: random.Random) -> list[float]:
    """SIGKILL a random rank every ``every`` seconds until ``stop``; the kill times."""
    kills = []
    while time.monotonic() + every < stop:
        time.sleep(every)
        ranks = rank_pids(server_pid)
        if ranks:
            os.kill(rng.choice(ranks), signal.SIGKILL)
            kills.append(time.monotonic())
    return kills


def idle_metrics(base: str, timeout: float) -> dict[str, float]:
    """The server's gauges once it is idle (nothing running or waiting, no KV block in use), or at the timeout."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    while True:
        text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
        m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        busy = m["ctxpar:num_requests_running"] + m["ctxpar:num_requests_waiting"] + m["ctxpar:kv_cache_usage_perc"]
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


class Tally:
    """Outcomes so far (client threads add, the main thread reads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kinds: collections.Counter[str] = collections.Counter()
        self.latencies: list[float] = []

    def add(self, o: Outcome) -> None:
        with self.lock:
            self.kinds[o.kind] += 1
            if o.latency is not None:
                self.latencies.append(o.latency)

    def errors(self) -> dict[str, int]:
        return {k: n for k, n in self.kinds.items() if k not in EXPECTED}


def run(args: argparse.Namespace) -> None:
    from ctxpar.bench.machine_line import describe_machine
    from ctxpar.bench.server_process import free_port, percentile, start_server
    from ctxpar.errors import CtxparError

    url = urllib.parse.urlsplit(args.url or "http://127.0.0.1")
    if url.scheme != "http" or url.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise CtxparError(f"--url must be an http:// loopback address (this benchmark sends load), got {args.url!r}")
    if args.abort_rate + args.bad_rate > 1:
        raise CtxparError("--abort-rate and --bad-rate must add up to at most 1")
    if args.kill_rank_every is not None and (args.url or args.pcp < 2):
        raise CtxparError("--kill-rank-every needs a server started here (no --url) with --pcp 2 or more")
    print(describe_machine())
    port = (url.port or 8000) if args.url else free_port()
    server = None if args.url else start_server(args, port, extra=())
    host, base = url.hostname, f"http://{url.hostname}:{port}"
    pids = lambda: process_tree(server.pid) if server is not None else []  # noqa: E731
    rss = lambda: (rss_mb(server.pid) if server else 0.0, sum(map(rss_mb, pids())))  # noqa: E731
    tally, stop = Tally(), time.monotonic() + args.duration
    try:
        warm = plan(random.Random(args.seed), args.max_prompt_words, 4, 0.0, 0.0)
        send(host, port, warm, timeout=300)
        start_rss = rss()
        clients = f"P={args.pcp}, {args.concurrency} clients, {args.duration} s"
        print(f"{clients}; RSS after warm-up {start_rss[0]:.0f} MiB", flush=True)

        def client(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < stop:
                p = plan(rng, args.max_prompt_words, args.max_tokens, args.abort_rate, args.bad_rate)
                tally.add(send(host, port, p, timeout=300))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.concurrency)]
        kills: list[float] = []
        if args.kill_rank_every is not None:
            assert server is not None  # checked above
            every, kill_rng = args.kill_rank_every, random.Random(args.seed)
            killer = lambda: kills.extend(kill_ranks(server.pid, every, stop, kill_rng))  # noqa: E731
            threads.append(threading.Thread(target=killer, daemon=True))
        for t in threads:
            t.start()
        t0 = time.monotonic()
        print("    s  served  left  refused  errors  RSS rank 0 / all MiB")

        def line() -> None:
            with tally.lock:
                k, errs = dict(tally.kinds), sum(tally.errors().values())
            r0, total = rss()
            served, left, refused = k.get("ok", 0), k.get("left", 0), k.get("refused", 0)
            elapsed = time.monotonic() - t0
            print(f"{elapsed:5.0f} {served:7d} {left:5d} {refused:8d} {errs:7d}  {r0:6.0f} / {total:.0f}", flush=True)

        while (rest := stop - time.monotonic()) > 0:
            time.sleep(min(args.report_every, rest))
            line()
        for t in threads:
            t.join()  # each finishes the request it was sending
        line()
        m = idle_metrics(base, timeout=60)
        end_rss = rss()
        health = json.loads(urllib.request.urlopen(base + "/health", timeout=30).read())
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    report(tally, m, start_rss, end_rss, args.duration, percentile)
    if args.kill_rank_every is not None:
        recovered = health["rank_recoveries"] == len(kills) == health["rank_failures"]
        print(
            f"ranks killed {len(kills)}, found lost {health['rank_failures']}, recovered {health['rank_recoveries']}; "
            f"/health {health['status']} on {health['pcp_ranks']} of {args.pcp} ranks"
        )
        if not recovered or health["status"] != "healthy":
            raise SystemExit(1)


def report(tally: Tally, m: dict[str, float], start: tuple, end: tuple, duration: int, percentile) -> None:
    served, lat = tally.kinds.get("ok", 0), tally.latencies
    print(
        f"requests served {served} ({served / duration:.2f}/s), clients that left {tally.kinds.get('left', 0)}, "
        f"bad requests refused with a 400 {tally.kinds.get('refused', 0)}"
    )
    print(f"errors by kind: {tally.errors() or 'none'}")
    print(f"latency of served requests: p50 {percentile(lat, 50):.2f} s, p99 {percentile(lat, 99):.2f} s")
    print(
        f"RSS rank 0 / all: {start[0]:.0f} / {start[1]:.0f} MiB after warm-up, "
        f"{end[0]:.0f} / {end[1]:.0f} MiB idle at the end"
    )
    free = m["ctxpar:kv_cache_usage_perc"] == 0 and m["ctxpar:num_requests_running"] == 0
    free = free and m["ctxpar:num_requests_waiting"] == 0
    print(f"KV cache at the end: {'fully free' if free else 'NOT free'} (usage {m['ctxpar:kv_cache_usage_perc']:.4f})")
    if tally.errors() or not free:
        raise SystemExit(1)
