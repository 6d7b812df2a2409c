"""A real `ctxpar serve` process on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 600  # a loaded machine, several ranks: generous
STOP_TIMEOUT_S = 60
# uvicorn shuts down gracefully on SIGTERM or SIGINT, then may re-raise the
# signal so the exit status says what ended the process.
STOPPED = (0, -signal.SIGTERM, -signal.SIGINT, 130)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), so a test can check none outlives it."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


class Server:
    """Starts ``ctxpar serve ARGS`` and waits for /health; ``stop`` sends SIGTERM."""

    def __init__(self, args: list[str], api_key: str | None = None, log: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        env = dict(os.environ)
        if api_key is not None:
            env["CTXPAR_API_KEY"] = api_key  # the environment route; the flag is the other
        self.log_path = log
        self._log = open(log, "w") if log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ctxpar.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ctxpar serve exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ctxpar serve did not start in {START_TIMEOUT_S} s: {self.log()}")
            time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path is not None else ""

    def openai(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", timeout=300, max_retries=0, **kw)

    def async_openai(self, **kw):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", timeout=300, max_retries=0, **kw)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """/metrics, parsed: {sample name: value} (label sets of one name: the last wins)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", headers=self.headers(), timeout=60).text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """The metrics once no request runs or waits and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["ctxpar:kv_cache_usage_perc"] == 0 and m["ctxpar:num_requests_running"] == 0:
                if m["ctxpar:num_requests_waiting"] == 0:
                    return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server is not idle after {timeout} s: {m}")
            time.sleep(0.1)

    def descendants(self) -> list[int]:
        return children(self.proc.pid)

    def rank_pid(self) -> int:
        """The PCP rank 1 process (spawned by rank 0; not multiprocessing's resource tracker)."""
        for pid in self.descendants():
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return pid
        raise AssertionError("no PCP worker process found")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig``, then wait; returns the exit code. Raises if a child process (a PCP rank) outlives it."""
        kids = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (orphans := [k for k in kids if alive(k)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        if orphans:
            raise AssertionError(f"processes {orphans} outlived the server")
        return self.proc.returncode
