"""Two hosts, not one: torchrun --nnodes 2 with one node in each of two
network namespaces joined by a veth pair (10.203.0.1 and 10.203.0.2), so the
ranks meet and all-gather over a real link between distinct addresses rather
than loopback. The output must equal one rank's, and killing one "host" must
fail the other fast with a clear message.

Needs root and iproute2 (`ip netns`); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.bench.netns import kill_tree
from helpers.workloads import long_prompts

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

ADDRS = ("10.203.0.1", "10.203.0.2")
MASTER_PORT = 29611  # inside the namespaces: nothing else listens there
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    """[(namespace, interface)] for node 0 (10.203.0.1) and node 1 (10.203.0.2); removed afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: cannot create network namespaces")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = uuid.uuid4().hex[:6]
    nodes = [(f"ctxpar-{tag}-{i}", f"cpv{tag}{i}") for i in range(2)]
    try:
        ip("netns", "add", nodes[0][0])
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace here: {e.stderr.strip()}")
    try:
        ip("netns", "add", nodes[1][0])
        ip("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for (ns, dev), addr in zip(nodes, ADDRS):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for ns, _ in nodes:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


SCRIPT = """
import json, sys, time
sys.path[:0] = [{here!r}, {tests!r}]  # this module, helpers
from ctxpar import LLM, RankFailure, SamplingParams
from helpers.workloads import long_prompts
from test_two_hosts import GREEDY
try:
    with LLM({model!r}, pcp_size=2, pcp_min_tokens=0) as llm:  # rank 1 serves in here
        outs = llm.generate(long_prompts(3, 300), GREEDY, use_tqdm=False)
        print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
        while {keep_going}:  # long prefills until the other host goes away
            llm.generate(long_prompts(4, 400), GREEDY, use_tqdm=False)
except RankFailure as e:
    print("FAILED", time.monotonic(), e, flush=True)
    sys.exit(1)  # a failed rank ends its torchrun at once (success would wait for the other node)
"""


def start_nodes(hosts, model: str, tmp_path, keep_going: bool) -> list[subprocess.Popen]:
    script = tmp_path / f"two_hosts_{keep_going}.py"
    here = os.path.dirname(__file__)
    tests = os.path.dirname(here)
    script.write_text(textwrap.dedent(SCRIPT.format(here=here, tests=tests, model=model, keep_going=keep_going)))
    procs = []
    for rank, (ns, dev) in enumerate(hosts):
        # gloo binds to the address of this interface, not the hostname's.
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=dev)
        cmd = [
            "ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr", ADDRS[0],
            "--master-port", str(MASTER_PORT), str(script),
        ]  # fmt: skip
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(subprocess.Popen(cmd, **pipes, env=env, start_new_session=True))
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        kill_tree(p.pid)
        p.wait(30)


def test_two_hosts_generate_what_one_rank_does(hosts, tiny_model_dirs, tmp_path):
    model = str(tiny_model_dirs["llama"])
    procs = start_nodes(hosts, model, tmp_path, keep_going=False)
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        stop(procs)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    lines = [l for l in outs[0][0].splitlines() if l.startswith("TOKENS ")]
    assert len(lines) == 1 and "TOKENS" not in outs[1][0]  # node 1 served and generated nothing itself
    with LLM(model) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(long_prompts(3, 300), GREEDY, use_tqdm=False)]
    assert json.loads(lines[0][len("TOKENS ") :]) == want


def kill_host_and_wait(hosts, model: str, tmp_path, victim: int) -> tuple[float, str]:
    """Start both nodes, kill node `victim` (its rank and torchrun agent) once
    long prefills are under way, and return how long the other node took to
    report the failure and the message it printed."""
    survivor = 1 - victim
    procs = start_nodes(hosts, model, tmp_path, keep_going=True)
    try:
        assert procs[0].stdout.readline().startswith("TOKENS "), procs[0].stderr.read()[-3000:]
        time.sleep(0.5)  # inside the long prefills
        killed = time.monotonic()
        kill_tree(procs[victim].pid)
        out, err = procs[survivor].communicate(timeout=120)
    finally:
        stop(procs)
    failed = [line for line in out.splitlines() if line.startswith("FAILED ")]
    assert failed and procs[survivor].returncode == 1, err[-3000:]
    _, when, message = failed[0].split(" ", 2)
    return float(when) - killed, message


def test_killing_one_host_fails_the_other_fast(hosts, tiny_model_dirs, tmp_path):
    """Node 1 (rank 1 and its torchrun agent) is killed while rank 0 runs
    long prefills: rank 0's collective fails as the link's sockets close and
    it raises RankFailure within seconds, not after a timeout."""
    took, message = kill_host_and_wait(hosts, str(tiny_model_dirs["llama"]), tmp_path, victim=1)
    assert took < 10
    assert "a PCP rank failed during a step" in message and ADDRS[1] in message  # names the peer host


def test_killing_rank_0s_host_ends_the_other_host(hosts, tiny_model_dirs, tmp_path):
    """The other way round: rank 1 waits for rank 0's next plan or is inside
    a step with it; when node 0 goes away that fails at once and LLM() on
    rank 1 raises RankFailure saying so."""
    took, message = kill_host_and_wait(hosts, str(tiny_model_dirs["llama"]), tmp_path, victim=0)
    assert took < 10
    assert message.startswith("PCP rank 1 lost rank 0") and ADDRS[0] in message
