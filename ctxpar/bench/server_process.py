"""Servers the serving benchmarks start and the streamed requests they time (bench serve, bench clients).

A server is a `ctxpar serve` process on a free loopback port, waited for through /health; a request
is a streamed /v1/completions whose server-sent events are timed as they arrive.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Timing:
    """One streamed request: when it was sent, when each token arrived."""

    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per token
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def stream_completion(host: str, port: int, body: dict, timeout: float) -> Timing:
    """POST a streaming /v1/completions and time its server-sent events."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        t = Timing(sent=time.perf_counter())
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"the server answered {resp.status}: {resp.read().decode()[:300]}")
        while line := resp.readline():
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter()
            for choice in json.loads(line[6:]).get("choices", []):
                ids = choice.get("token_ids") or []
                t.arrivals += [now] * len(ids)  # tokens of one event arrived together
                t.token_ids += ids
        return t
    finally:
        conn.close()


def sweep_level(
    host: str, port: int, bodies: list[dict], clients: int, deadline: float, seconds: float | None = None
) -> tuple[list[Timing], float]:
    """Send bodies with `clients` threads, each taking the next body when its last one ends:
    every body once, or with ``seconds``, cycling through them until that many seconds have
    passed (the requests then in flight run to their end). Returns the timings in sending
    order and the level's start (time.perf_counter)."""
    results: dict[int, Timing] = {}
    errors: list[BaseException] = []
    lock, next_index = threading.Lock(), [0]
    t0 = time.perf_counter()

    def client() -> None:
        while not errors:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(bodies) if seconds is None else time.perf_counter() - t0 >= seconds:
                return
            try:
                results[i] = stream_completion(
                    host, port, bodies[i % len(bodies)], timeout=max(1.0, deadline - time.monotonic())
                )
            except BaseException as e:  # noqa: BLE001 - reported once below
                errors.append(e)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    if errors or any(th.is_alive() for th in threads):
        raise RuntimeError(f"at concurrency {clients}: {errors[0] if errors else 'the sweep ran past --timeout'}")
    return [results[i] for i in sorted(results)], t0


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    args: argparse.Namespace,
    port: int,
    extra: tuple[str, ...] = ("--no-prefix-caching",),
    quantization: str | None = "none",
) -> subprocess.Popen:
    """`ctxpar serve` on loopback with a benchmark's engine flags (args.model, .pcp, .threads)
    and ``extra``; returns once /health answers 200. Here prefix caching is off, as
    offline: each level resends the same prompts. ``quantization`` None: ctxpar's default;
    "none" (a GGUF dequantized) is what the offline figures of docs/benchmarks.md load."""
    cmd = [sys.executable, "-m", "ctxpar.cli", "serve", "--port", str(port), "--pcp", str(args.pcp), *extra]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--quantization", quantization] if quantization else []
    cmd += ["--threads", str(args.threads)] if args.threads else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return wait_healthy(proc, port, "the server", timeout=300)


def wait_healthy(proc: subprocess.Popen, port: int, name: str, timeout: float) -> subprocess.Popen:
    """``proc`` once its /health on loopback answers 200; killed, with its stderr's tail, if it exits or
    does not answer within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stderr = proc.stderr.read() if proc.stderr is not None else ""
            raise RuntimeError(f"{name} exited with status {proc.returncode}: {stderr[-500:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{name} did not answer /health within {timeout:.0f} s")
