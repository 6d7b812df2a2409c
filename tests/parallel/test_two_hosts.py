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
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from ctxpar import LLM, SamplingParams
from ctxpar.costmodel.netns import kill_tree
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
    with LLM({model!r}, pcp_size=2, pcp_min_tokens=0, max_rank_recoveries=0) as llm:  # rank 1 serves in here
        outs = llm.generate(long_prompts(3, 300), GREEDY, use_tqdm=False)
        print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
        while {keep_going}:  # long prefills until the other host goes away
            llm.generate(long_prompts(4, 400), GREEDY, use_tqdm=False)
except RankFailure as e:
    print("FAILED", time.monotonic(), e, flush=True)
    sys.exit(1)  # a failed rank ends its torchrun at once (success would wait for the other node)
"""


# Requests in flight when node 1 is lost: rank 0 goes on alone (recovery on).
IN_FLIGHT_SCRIPT = """
import json, sys, time
sys.path[:0] = [{here!r}, {tests!r}]
from ctxpar import LLM
from helpers.workloads import long_prompts
from test_two_hosts import GREEDY
with LLM({model!r}, pcp_size=2, pcp_min_tokens=0) as llm:
    engine, out = llm.llm_engine, {{}}
    for i, p in enumerate(long_prompts(3, 300)):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(3):  # the prefills, split over both hosts, and two decodes
        engine.step()
    print("READY", flush=True)
    sys.stdin.readline()  # node 1 is gone now
    while llm.engine.recovery.rank_failures == 0:  # idle (as a server between requests): heartbeats
        llm.engine.check_health()
        time.sleep(0.1)
    while engine.has_unfinished_requests():
        out.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
    rec = llm.engine.recovery
    print("TOKENS", json.dumps([out[str(i)] for i in range(3)]), rec.recoveries, rec.pcp_ranks, flush=True)
"""


def start_nodes(hosts, model: str, tmp_path, keep_going: bool | None) -> list[subprocess.Popen]:
    """keep_going None: IN_FLIGHT_SCRIPT, else SCRIPT."""
    script = tmp_path / f"two_hosts_{keep_going}.py"
    here = os.path.dirname(__file__)
    tests = os.path.dirname(here)
    text = SCRIPT if keep_going is not None else IN_FLIGHT_SCRIPT
    script.write_text(textwrap.dedent(text.format(here=here, tests=tests, model=model, keep_going=keep_going)))
    procs = []
    secret = secrets.token_hex(32)  # the hosts' shared one
    for rank, (ns, dev) in enumerate(hosts):
        # gloo binds to the address of this interface, not the hostname's.
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=dev, CTXPAR_CLUSTER_SECRET=secret)
        cmd = [
            "ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr", ADDRS[0],
            "--master-port", str(MASTER_PORT), str(script),
        ]  # fmt: skip
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


def lose_host_and_wait(hosts, model: str, tmp_path, victim: int, cut_link: bool = False) -> tuple[float, str]:
    """Start both nodes, lose node `victim` once long prefills are under way, and
    return how long the other node took to report the failure and the message it
    printed. Lost: its rank and torchrun agent killed (their sockets close), or,
    with cut_link, its end of the link set down (nothing closes; the processes
    live on, cut off)."""
    survivor = 1 - victim
    procs = start_nodes(hosts, model, tmp_path, keep_going=True)
    ns, dev = hosts[victim]
    try:
        assert procs[0].stdout.readline().startswith("TOKENS "), procs[0].stderr.read()[-3000:]
        time.sleep(0.5)  # inside the long prefills
        lost = time.monotonic()
        if cut_link:
            ip("-n", ns, "link", "set", dev, "down")
        else:
            kill_tree(procs[victim].pid)
        out, err = procs[survivor].communicate(timeout=120)
    finally:
        stop(procs)
        ip("-n", ns, "link", "set", dev, "up")
    failed = [line for line in out.splitlines() if line.startswith("FAILED ")]
    assert failed and procs[survivor].returncode == 1, err[-3000:]
    _, when, message = failed[0].split(" ", 2)
    return float(when) - lost, message


def test_a_lost_host_leaves_rank_0_going_on_alone(hosts, tiny_model_dirs, tmp_path):
    """Node 1 (rank 1 and its torchrun agent) is killed with requests in flight, between
    steps: rank 0's idle health check sees rank 1's heartbeat stop, and rank 0 goes on
    as a group of one (torchrun's ranks are not ctxpar's to respawn) with the whole KV
    cache it holds: the requests finish with one rank's tokens."""
    model = str(tiny_model_dirs["llama"])
    procs = start_nodes(hosts, model, tmp_path, keep_going=None)
    try:
        assert procs[0].stdout.readline() == "READY\n", procs[0].stderr.read()[-3000:]
        kill_tree(procs[1].pid)
        procs[1].wait(30)
        procs[0].stdin.write("go\n")
        procs[0].stdin.flush()
        line = procs[0].stdout.readline()  # rank 0's torchrun then waits for node 1 at its exit: not awaited
    finally:
        stop(procs)
    assert line.startswith("TOKENS "), procs[0].stderr.read()[-3000:]
    tokens, recoveries, ranks = line[len("TOKENS ") :].rsplit(" ", 2)
    assert (int(recoveries), int(ranks)) == (1, 1)
    with LLM(model) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(long_prompts(3, 300), GREEDY, use_tqdm=False)]
    assert json.loads(tokens) == want


def test_killing_one_host_fails_the_other_fast(hosts, tiny_model_dirs, tmp_path):
    """With recovery off: node 1 (rank 1 and its torchrun agent) is killed while
    rank 0 runs long prefills: rank 0's collective fails as the link's sockets
    close and it raises RankFailure within seconds, not after a timeout."""
    took, message = lose_host_and_wait(hosts, str(tiny_model_dirs["llama"]), tmp_path, victim=1)
    assert took < 10, message
    assert "a PCP rank failed during a step" in message and ADDRS[1] in message  # names the peer host


def test_cutting_one_hosts_link_fails_the_other_fast(hosts, tiny_model_dirs, tmp_path):
    """Node 1's link goes down while rank 0 runs long prefills: no socket closes, so
    rank 0's collective would wait out the collective timeout (30 s); rank 0's step
    watch sees rank 1's heartbeat stop and cuts the group's links, and RankFailure
    names the silent rank within seconds."""
    took, message = lose_host_and_wait(hosts, str(tiny_model_dirs["llama"]), tmp_path, victim=1, cut_link=True)
    assert took < 10, message
    assert "a PCP rank failed during a step: PCP rank 1's heartbeat stopped" in message


def test_killing_rank_0s_host_ends_the_other_host(hosts, tiny_model_dirs, tmp_path):
    """The other way round: rank 1 waits for rank 0's next plan or is inside
    a step with it; when node 0 goes away that fails at once and LLM() on
    rank 1 raises RankFailure saying so."""
    took, message = lose_host_and_wait(hosts, str(tiny_model_dirs["llama"]), tmp_path, victim=0)
    assert took < 10, message
    assert message.startswith("PCP rank 1 lost rank 0") and ADDRS[0] in message
