"""Process faults around the PCP ranks, each timed to a clear error: a worker
that dies while starting (no main guard, killed), a worker killed inside a
step's collectives, rendezvous addresses and ports that cannot work, more
ranks than the machine, torchrun with a world size other than pcp_size, and
the CLI's exit status and single error line for a dead rank and for Ctrl-C."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError, RankFailure
from ctxpar.executor.multiproc import free_port
from ctxpar.executor.preflight import max_local_ranks
from ctxpar.executor.rank_processes import EXIT_GRACE_S, RankProcesses
from helpers.procs import main_thread_leaves_first
from helpers.tiny_tokenizer import with_byte_tokenizer
from helpers.workloads import long_prompts

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dirs, tmp_path_factory) -> str:
    """The tiny Llama with a byte tokenizer, so the CLI can take text."""
    return str(with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("faults") / "llama"))


def run_script(tmp_path, body: str, timeout: float = 240) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=tmp_path
    )


@pytest.mark.multiprocess
def test_script_without_main_guard_names_the_dead_rank_within_seconds(model, tmp_path):
    """Spawned ranks re-import __main__: without `if __name__ == "__main__":`
    the child would build an LLM of its own. It exits at once and rank 0
    names it, its exit code and the fix, instead of timing out after 600 s."""
    done = run_script(
        tmp_path,
        f"""
        import time
        from ctxpar import LLM
        t = time.monotonic()
        try:
            LLM({model!r}, pcp_size=2)
        except Exception as e:
            print(f"{{type(e).__name__}} {{time.monotonic() - t:.1f}}: {{e}}")
        """,
    )
    assert done.returncode == 0, done.stderr
    kind, seconds, message = done.stdout.split(" ", 2)
    assert kind == "RankFailure", done.stdout
    assert "PCP rank 1 exited with code 1 during start-up" in message
    assert 'if __name__ == "__main__":' in message
    assert float(seconds.rstrip(":")) < 30  # model loads included; the poll itself takes 0.1 s
    assert "Traceback" not in done.stderr  # the child says one line, not multiprocessing's traceback
    assert 'if __name__ == "__main__":' in done.stderr


@pytest.mark.multiprocess
def test_worker_killed_while_starting_is_named_at_once(model):
    """A worker that dies before rank 0's handshake completes (here SIGKILL
    while it imports and loads) is noticed by the poll, not a timeout."""
    killed: list[float] = []

    def kill_the_worker() -> None:
        while not multiprocessing.active_children():
            time.sleep(0.01)
        (worker,) = multiprocessing.active_children()
        time.sleep(0.5)
        os.kill(worker.pid, signal.SIGKILL)
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill_the_worker)
    killer.start()
    with pytest.raises(RankFailure, match="PCP rank 1 was killed by SIGKILL during start-up"):
        LLM(model, pcp_size=2)
    killer.join()
    assert time.monotonic() - killed[0] < 5
    assert multiprocessing.active_children() == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("dcp", [1, 2], ids=["replicated-KV", "sharded-KV"])
def test_worker_killed_inside_a_step_fails_the_step_fast(model, dcp, monkeypatch):
    """SIGKILL a worker while long prefills run (pcp_min_tokens=0: every step
    all-gathers; with the KV sharded, every layer also exchanges partial
    attention all-to-all): the collective rank 0 is in fails as soon as the
    peer has gone, not after the collective timeout (made long here, so that a
    loaded host's slower step is never mistaken for it), and the error names the
    rank and the signal (recovery off: tests/executor/test_rank_recovery.py has it on)."""
    monkeypatch.setenv("CTXPAR_COLLECTIVE_TIMEOUT_S", "120")
    llm = LLM(model, pcp_size=2, dcp_size=dcp, pcp_min_tokens=0, max_num_batched_tokens=256, max_rank_recoveries=0)
    (worker,) = multiprocessing.active_children()
    killed: list[float] = []

    def kill_mid_generate() -> None:
        while llm.engine.num_steps < 3:  # generate is under way
            time.sleep(0.005)
        os.kill(worker.pid, signal.SIGKILL)
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill_mid_generate)
    killer.start()
    try:
        with pytest.raises(RankFailure, match="rank 1 was killed by SIGKILL"):
            llm.generate(long_prompts(8), LONG, use_tqdm=False)
        killer.join()
        assert time.monotonic() - killed[0] < 30
        with pytest.raises(RankFailure, match="create a new LLM"):  # the LLM says so from then on
            llm.generate(long_prompts(1), LONG, use_tqdm=False)
    finally:
        llm.close()
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_worker_seen_ending_is_named_by_its_exit_not_taken_for_alive():
    """A collective fails the moment a peer's main thread has gone, but the process's
    exit code comes only after its other threads (on a loaded host: seconds later):
    rank 0 waits for it, so the error names how the rank ended."""
    ctx = multiprocessing.get_context("spawn")  # not fork: a forked copy of a threaded process can hang
    release = ctx.Event()
    proc = ctx.Process(target=main_thread_leaves_first, args=(release, 7))
    proc.start()
    ranks = RankProcesses(2)
    ranks.procs = [proc]
    try:
        deadline = time.monotonic() + 60
        while b") Z " not in open(f"/proc/{proc.pid}/stat", "rb").read():  # the main thread has left
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert proc.is_alive()
        # The last thread leaves after rank 0's first grace for an exit code has run out.
        threading.Timer(EXIT_GRACE_S + 1, release.set).start()
        ranks.await_exits()
        assert ranks.lost(2, heartbeats=False) == "PCP rank 1 exited with code 7"
    finally:
        release.set()  # never leave it waiting
        proc.join(timeout=30)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(master_addr="10.203.255.1"), ["'10.203.255.1'", "not an address of this machine", "torchrun"]),
        (dict(master_addr="no-such-host.invalid"), ["does not resolve", "127.0.0.1"]),
        (dict(pcp_size=1000), ["pcp_size=1000", f"limit is {max_local_ranks(torch.device('cpu'))}"]),
    ],
)
def test_unusable_rendezvous_or_size_fails_before_loading(model, kwargs, words):
    """Refused before the model load and before any process is spawned."""
    start = time.monotonic()
    with pytest.raises(CtxparError) as e:
        LLM(model, **{"pcp_size": 2, **kwargs})
    assert time.monotonic() - start < 5
    for w in words:
        assert w in str(e.value)
    assert multiprocessing.active_children() == []


@pytest.mark.multiprocess
def test_busy_master_port_is_one_clear_error(model):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CtxparError, match=f"master_port {port} is already in use.*--master-port"):
            LLM(model, pcp_size=2, master_port=port)
    assert multiprocessing.active_children() == []
    # And a free one given explicitly works.
    with LLM(model, pcp_size=2, master_port=free_port()) as llm:
        assert len(llm.generate(long_prompts(1, 20), SamplingParams(max_tokens=2), use_tqdm=False)) == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("pcp", [1, 3])
def test_torchrun_world_size_other_than_pcp_is_one_error_per_rank(model, pcp):
    """Two processes with --pcp 1 would be two engines printing everything
    twice; with --pcp 3 a rank would be missing. Each rank refuses before
    loading the model, with one error line, and nothing is generated."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "ctxpar.cli", "generate", "--model", model, "--prompt", "Hello", "--max-tokens", "4", "--pcp", str(pcp),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV)
    assert done.returncode != 0
    assert done.stdout.strip() == ""  # no generated text, from either rank
    # Every rank refuses; torchrun stops the others once the first has exited,
    # sometimes before they print, so one or two lines, each about its own rank.
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert 1 <= len(errors) <= 2, done.stderr[-3000:]
    for line in errors:
        assert f"torchrun started 2 processes but pcp_size is {pcp} (this is rank " in line
        assert "--pcp 2" in line
    assert len({line for line in errors}) == len(errors)
    assert "CtxparError" not in done.stderr  # no rank printed a traceback (torchrun prints its own summary)


def start_cli(model: str, *args: str) -> subprocess.Popen:
    """`ctxpar generate --pcp 2` in a process group of its own, as a terminal runs it."""
    cmd = [sys.executable, "-m", "ctxpar.cli", "generate", "--model", model, "--pcp", "2", "--pcp-min-tokens", "0"]
    return subprocess.Popen(
        [*cmd, "--prompt", "x" * 300, "--max-tokens", "200", "--ignore-eos", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a terminal's Ctrl-C, even if
    )  # fmt: skip                     # this run's shell started it in the background (SIGINT ignored)


def wait_for_text(proc: subprocess.Popen) -> None:
    """Block until the CLI streams its first character: the ranks are up."""
    assert proc.stdout.read(1), proc.stderr.read()


def spawned_workers(pid: int) -> list[int]:
    """The PCP ranks spawned by `pid` (not multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(p) for p in f.read().split()]
    return [k for k in kids if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]


def running(pid: int) -> bool:
    """Alive and not a zombie (PID 1 of a container may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.multiprocess
def test_cli_dead_rank_exits_1_with_one_error_line(model):
    proc = start_cli(model, "--max-rank-recoveries", "0")  # recovery off: the fatal path
    wait_for_text(proc)
    (worker,) = spawned_workers(proc.pid)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed < 15
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    [line] = err.strip().splitlines()
    # Found inside a step's collectives or by the check before the next step: either way one line saying so.
    assert line.startswith("error: ") and "rank 1 was killed by SIGKILL" in line, line


@pytest.mark.multiprocess
def test_cli_ctrl_c_exits_130_without_any_traceback(model):
    """The terminal's Ctrl-C goes to the whole process group, workers
    included: rank 0 says "interrupted" and stops them; they print nothing."""
    proc = start_cli(model)
    wait_for_text(proc)
    (worker,) = spawned_workers(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == "error: interrupted"
    assert not running(worker)  # rank 0 stopped the worker before it exited


@pytest.mark.multiprocess
def test_workers_leave_when_rank_0_is_killed(model):
    """SIGKILL rank 0 mid-generation: no orphan keeps running; the worker's
    wait or collective fails as rank 0's sockets close, and it exits with
    one line instead of a traceback."""
    proc = start_cli(model)
    wait_for_text(proc)
    (worker,) = spawned_workers(proc.pid)
    proc.kill()
    killed = time.monotonic()
    while running(worker) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    assert not running(worker)
    assert time.monotonic() - killed < 10
    _, err = proc.communicate(timeout=30)  # the worker's stderr is the same pipe
    assert "ctxpar: PCP rank 1 lost rank 0" in err and "Traceback" not in err, err
