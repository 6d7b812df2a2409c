"""Nothing recorded in one launch or one generation of the ranks is obeyed in
another, nothing a rank receives is code, and the store's key names give a
guesser nothing: each test performs the attack with real rank processes
(issue 52, findings 4, 5, 6 and 8).

- a step plan sealed by generation 0 of a group, replayed to a generation-1
  worker at the same message number, is refused (the same plan sealed by
  generation 1 is taken);
- values recorded on the store of a torchrun launch and written into the
  next launch's store (same secret) are not obeyed: a rank answers only the
  nonce agreement that names its own fresh nonce;
- under ``CTXPAR_INSECURE_CLUSTER=1`` (no secret: anyone can tag) a pickle
  that would create a file is refused as not being a message of the wire
  format, and the file is never created;
- a weak cluster secret is refused, naming the fix;
- the key names of a live launch's store hold nothing derived from the secret;
- an unsigned ``ready/r`` or ``alive/g/r`` is not counted;
- a live engine whose rank 1 was respawned refuses plans tagged by its
  group's previous generation.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError, RankFailure
from ctxpar.executor import regroup, startup
from ctxpar.parallel.auth import derive_key
from ctxpar.parallel.cluster_secret import MIN_BITS, cluster_secret, estimated_bits
from ctxpar.parallel.rendezvous_store import host_store
from ctxpar.parallel.signed_store import SignedStore
from helpers.attack_ranks import SECRET as PLAN_SECRET
from helpers.attack_ranks import run_plan_attack
from helpers.replay_ranks import BOOTSTRAP, PREFIX, SECRET, agreeing_rank, ready_rank

pytestmark = pytest.mark.multiprocess

_HEX_RUN = re.compile(r"[0-9a-f]{16,}")  # a hash or a nonce in a key name


@pytest.mark.parametrize("shm", [True, False], ids=["shared-pages", "gloo"])
def test_a_plan_of_generation_0_is_refused_by_a_generation_1_worker(tmp_path, shm):
    """The attack: after a recovery the group's message count starts again at 0, so a
    plan recorded from generation 0 (message 0, genuine tag) is sent to a worker of
    generation 1 as its message 0. The tag is keyed by the generation: refused."""
    verdict, text = run_plan_attack(shm, "generation 0", tmp_path / "unused", victim=(PLAN_SECRET, "g1/"))
    assert verdict == "refused", text
    assert "failed authentication" in text and "generation" in text
    verdict, text = run_plan_attack(shm, "generation 1", tmp_path / "unused", victim=(PLAN_SECRET, "g1/"))
    assert verdict == "received" and text.startswith("StepPlan("), text  # its own generation's plan is taken


def test_a_pickle_under_insecure_cluster_runs_nothing(tmp_path):
    """The attack: with CTXPAR_INSECURE_CLUSTER=1 the ranks' key is public, so anyone
    can send a message whose tag checks. Its payload is a pickle that creates a
    file when loaded; the worker decodes messages as data only: it refuses it,
    saying why, and the file is never created."""
    target = tmp_path / "pwned"
    verdict, text = run_plan_attack(False, "insecure", target, victim=(b"", "g0/"))
    assert verdict == "refused", text
    assert "not one of ctxpar's wire format" in text and "nothing in it was run" in text
    assert not target.exists()


def _agree(ranks: list[tuple], timeout_s: float) -> dict[tuple[int, int], tuple[str, str]]:
    """Ranks of torchrun launches of two agreeing on their nonces, each a process given
    (its store's port, its rank[, its secret]), all at once; their reports by (port, rank)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=agreeing_rank, args=(a[0], a[1], 2, timeout_s, results, *a[2:])) for a in ranks]
    for p in procs:
        p.start()
    try:
        reports = [results.get(timeout=120) for _ in ranks]
    finally:
        for p in procs:
            p.join(timeout=30)
    return {(port, rank): (outcome, what) for port, rank, outcome, what in reports}


def _record(store: dist.TCPStore) -> dict[str, bytes]:
    """Every key and raw value (tag included) on ``store``, as an eavesdropper lists them."""
    return {key: store.get(key) for key in store.list_keys()}


def _replay(port: int, values: dict[str, bytes]) -> None:
    """Write ``values`` as they are (recorded tags and all, or none), as anyone who reaches the store can."""
    client = dist.TCPStore("127.0.0.1", port, None, False)
    for key, value in values.items():
        client.set(key, value)  # type: ignore[arg-type]  # the store takes bytes


def test_a_value_of_an_earlier_launch_is_refused():
    """The attack: record the store of one torchrun launch (tags and all: the secret
    is the same in every launch), then write it into the next launch's store before
    its ranks get there. A worker alone finds the old launch's agreement, which does
    not name its fresh nonce: not obeyed; rank 0 alone finds the old rank 1's answer,
    which does not name rank 0's fresh nonce: not counted. Both ranks together agree
    on a new nonce, which the recorded values cannot fake."""
    first = host_store("127.0.0.1", 0)
    agreed = _agree([(first.port, 0), (first.port, 1)], 60)
    assert agreed[first.port, 0][0] == "agreed" and agreed[first.port, 0] == agreed[first.port, 1], agreed
    recorded = _record(first)
    assert {f"{BOOTSTRAP}/{k}" for k in ("hello", "ready/1", "launch")} <= set(recorded), recorded  # PrefixStore's /
    assert not any(_HEX_RUN.search(k) for k in recorded)  # fixed names: nothing of the secret in them

    worker_alone, rank0_alone, both = (host_store("127.0.0.1", 0) for _ in range(3))
    for store in (worker_alone, rank0_alone, both):
        _replay(store.port, recorded)
    runs = [(worker_alone.port, 1), (rank0_alone.port, 0), (both.port, 0), (both.port, 1)]
    reports = _agree(runs, 3)
    outcome, text = reports[worker_alone.port, 1]
    assert outcome == "failed" and "launch: a value of another launch" in text, text
    outcome, text = reports[rank0_alone.port, 0]
    assert outcome == "failed" and "ready/1: a value of another launch" in text, text
    fresh = reports[both.port, 0]
    assert fresh[0] == "agreed" and fresh == reports[both.port, 1], reports
    assert fresh[1] != agreed[first.port, 0][1]  # a new launch's nonce: every later key and tag is bound to it


def test_ranks_given_different_secrets_fail_at_once():
    """The usual mistake, not an attack: each host exported its own secret. The first
    value a rank reads from the other fails its tag, and it says so at once (not at
    the agreement's deadline), naming the likely cause."""
    store = host_store("127.0.0.1", 0)
    reports = _agree([(store.port, 0), (store.port, 1, b"another host's secret")], 10)
    outcome, text = reports[store.port, 1]
    assert outcome == "failed" and "failed authentication" in text and "different secrets" in text, text
    assert "did not agree" not in text  # refused on reading, not at the deadline
    assert reports[store.port, 0][0] == "failed"  # rank 0 heard nothing from it: its deadline


@pytest.mark.parametrize(
    "secret",
    [
        "0123456789abcdef0123456789abcdef",  # a run, repeated
        "a" * 64,
        "correcthorsebatterystaplecorrecthorse",  # words, repeated
        secrets.token_hex(12),  # random, but 96 bits
        "passwordpasswordpasswordpassword1",
    ],
    ids=["run", "one-letter", "words", "random-96-bits", "password"],  # stable: test workers must collect the same ids
)
def test_a_weak_secret_is_refused(monkeypatch, secret):
    """The attack it stops: guessing the secret offline from the tags a store client
    reads. A short or predictable one is refused, naming how to make one."""
    monkeypatch.delenv("CTXPAR_CLUSTER_SECRET_FILE", raising=False)
    monkeypatch.setenv("CTXPAR_CLUSTER_SECRET", secret)
    with pytest.raises(CtxparError, match=r"(characters; use at least 32|too predictable).*openssl rand -hex 32"):
        cluster_secret()


def test_generated_secrets_pass_the_entropy_check():
    for _ in range(200):
        for secret in (secrets.token_hex(32), secrets.token_urlsafe(32)):
            assert estimated_bits(secret) >= MIN_BITS, secret


def test_the_store_keys_of_a_launch_reveal_nothing_of_its_secret(tiny_model_dirs):
    """The attack: list the keys of a live launch's store, looking for anything computed
    from the secret (an offline guessing oracle). The only long hex string in any
    key name is the launch's nonce, which is random; the rest is fixed words and
    numbers, and no key derived from the secret appears."""
    with LLM(str(tiny_model_dirs["llama"]), pcp_size=2, num_threads=1, max_rank_recoveries=0) as llm:
        executor = llm.engine.executor
        code = textwrap.dedent(f"""
            import json, torch.distributed as dist
            print(json.dumps(dist.TCPStore("127.0.0.1", {executor._port}, None, False).list_keys()))
        """)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        keys = json.loads(done.stdout)
        launch = executor.launch
    nonce = launch.nonce.hex()
    assert any(k.endswith("/verdict") for k in keys), keys
    for key in keys:
        assert key.startswith(f"ctxpar/{nonce}/"), key
        assert not _HEX_RUN.search(key.replace(nonce, "")), key
    derived = [derive_key(launch.secret, label).hex()[:16] for label in ("store prefix", "store values", "step plans")]
    assert not any(d in key for d in derived for key in keys)


def test_an_unsigned_presence_key_is_not_counted():
    """The attack: while rank 1 is still loading its model, write ``ready/1`` (and a
    survivor's ``alive/1/1``) unsigned. Rank 0 counts neither: it waits on for rank 1
    (which is found missing at the deadline) and does not take the forged check-in
    for a survivor. The genuine rank 1's signed ready then counts."""
    server = host_store("127.0.0.1", 0)
    signed = SignedStore(server, SECRET)  # lives as long as the store built on it is used
    store = dist.PrefixStore(PREFIX, signed)
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    rank1 = ctx.Process(target=ready_rank, args=(server.port, go, results))
    rank1.start()
    try:
        _replay(server.port, {f"{PREFIX}/ready/1": b"", f"{PREFIX}/alive/1/1": b""})  # PrefixStore's names
        assert store.check(["ready/1", "alive/1/1"])  # the forged keys are there
        with pytest.raises(RankFailure, match=r"PCP rank\(s\) 1 not ready"):
            startup.await_ready(store, [1], {1: rank1}, time.monotonic() + 2)
        assert regroup.find_lost(store, 1, [1], lambda r: False, time.monotonic() + 1) == [1]
        go.set()
        startup.lead(store, 2, {1: rank1}, time.monotonic() + 60)
        assert results.get(timeout=60) == "joined"
    finally:
        go.set()
        rank1.join(timeout=30)
        if rank1.is_alive():
            rank1.kill()


def test_a_recovered_engine_refuses_its_previous_generations_plans(tiny_model_dirs, capfd):
    """The attack on a live engine: rank 1 is killed and respawned (generation 1 of the
    group, its message count at 0 again), then rank 0's channel carries plans tagged
    as generation 0 tagged them (as anything replaying recorded generation-0 messages
    at their numbers would). The respawned worker refuses the first and leaves."""
    prompt = [{"prompt_token_ids": list(range(20))}]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(str(tiny_model_dirs["llama"]), pcp_size=2, num_threads=1, max_rank_recoveries=1) as llm:
        want = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        executor = llm.engine.executor
        first = executor.group.seal  # generation 0's, as it tagged its plans
        [worker] = executor.procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == want  # respawned: gen 1
        group = executor.group
        first.seq = group.seal.seq  # the number the worker expects next: only the generation differs
        group.seal = first
        with pytest.raises(RankFailure, match="after refusing a forged message") as e:
            llm.generate(prompt, greedy, use_tqdm=False)
        assert "failed authentication" in str(e.value)
    assert "ctxpar: PCP rank 1: PCP message" in capfd.readouterr().err
