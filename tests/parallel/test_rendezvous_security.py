"""Nothing on the network or on the host can steer a rank: each test performs an
attack on the ranks' rendezvous, their plan channel or their shared segments,
and checks that it fails (issue 39, finding 1).

- the rendezvous store and gloo listen on loopback only: a connection to the
  store's port at a non-loopback address of this host is refused (torch's own
  TCPStore would take it), and no rank listens anywhere but on loopback;
- a client that reaches the store finds no keys under a guessed prefix, and
  the values it finds are not what the ranks act on until their tags check;
- a plan forged without the launch secret, or swapped in flight under a
  genuine tag, is refused before it is unpickled: the file its pickle would
  create is never created; a live engine's worker leaves with a clear error;
- a store value naming a file, forged or genuine, maps nothing but a private
  segment: forged values, symlinks, other users' files, world-writable files
  and files of the wrong size are refused;
- torchrun ranks without a shared secret refuse to start.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError, RankFailure
from ctxpar.executor.multiproc import free_port
from ctxpar.parallel.auth import PlanSeal, Unauthenticated, context
from ctxpar.parallel.cluster_secret import cluster_secret, stretch
from ctxpar.parallel.host_shm import SHM_DIR
from ctxpar.parallel.private_file import UnsafeFile, create_private, open_private
from ctxpar.parallel.rendezvous_store import host_store
from ctxpar.parallel.signed_store import SignedStore
from helpers.attack_ranks import PREFIX, SECRET, SEGMENT_BYTES, run_plan_attack, segment_victim
from helpers.procs import listening_addresses
from helpers.tiny_tokenizer import with_byte_tokenizer

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
NOBODY = 65534  # another user's uid (root can chown to it)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def outside_address():
    """A non-loopback IPv4 address of this host: one it has, else one added on a dummy interface."""
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: cannot find or add a non-loopback address")
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        addr = line.split()[3].split("/")[0]
        if not ipaddress.ip_address(addr).is_loopback:
            yield addr
            return
    if os.geteuid() != 0:
        pytest.skip("this host has no non-loopback address, and adding one needs root")
    dev, addr = f"ctxpar-t{os.getpid() % 10000}", "198.51.100.7"
    _ip("link", "add", dev, "type", "dummy")
    try:
        _ip("addr", "add", f"{addr}/32", "dev", dev)
        _ip("link", "set", dev, "up")
        yield addr
    finally:
        _ip("link", "del", dev)


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def _connect_from_another_process(addr: str, port: int) -> str:
    """What a second process gets when it connects to addr:port: "connected" or the error."""
    code = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({addr!r}, {port}), timeout=5).close(); print('connected')\n"
        "except OSError as e:\n"
        "    print(type(e).__name__)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()


@pytest.fixture
def engine(tiny_model_dirs):
    """Two spawned ranks serving the tiny Llama; listeners of this process before it started."""
    before = listening_addresses(os.getpid())
    with LLM(str(tiny_model_dirs["llama"]), pcp_size=2, num_threads=1, max_rank_recoveries=0) as llm:
        yield llm, before


@pytest.mark.multiprocess
def test_the_rendezvous_refuses_a_connection_to_a_non_loopback_address(engine, outside_address):
    """The attack: connect to the rendezvous port at this host's network address, as
    another machine (or a local user going around loopback) would. torch's TCPStore,
    left to itself, listens on every interface and takes the connection; the ranks'
    store refuses it, and no rank (the store, gloo) listens anywhere but on loopback."""
    llm, before = engine
    executor = llm.engine.executor
    port = executor._port
    default = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    assert _connect_from_another_process(outside_address, default.port) == "connected"  # the hole
    assert _connect_from_another_process(outside_address, port) == "ConnectionRefusedError"
    assert _connect_from_another_process("127.0.0.1", port) == "connected"  # the ranks' way in
    del default
    [worker] = executor.procs
    opened = listening_addresses(os.getpid()) - before
    listeners = opened | listening_addresses(worker.pid)
    assert ("127.0.0.1", port) in opened
    assert len(listeners) >= 3  # the store, and gloo's on both ranks
    assert all(_is_loopback(addr) for addr, _ in listeners), listeners


@pytest.mark.multiprocess
def test_a_client_on_the_store_finds_no_keys_under_guessed_prefixes(engine):
    """The attack: reach the store (from this host) and look for the handshake keys
    under the names ctxpar used to give them. There are none; the keys that exist
    are under a prefix derived from the launch secret, and their values are tagged:
    one forged in their place is refused by a rank that reads it."""
    llm, _ = engine
    port = llm.engine.executor._port
    code = textwrap.dedent(f"""
        import json, torch.distributed as dist
        from datetime import timedelta
        store = dist.TCPStore("127.0.0.1", {port}, None, False, timedelta(seconds=10))
        guesses = [f"ctxpar/{{n}}/{{sep}}{{k}}" for n in range(4) for sep in ("", "/") for k in ("verdict", "ready/1")]
        keys = store.list_keys()
        verdict = [k for k in keys if k.endswith("/verdict")]
        value = store.get(verdict[0]).hex() if verdict else ""
        found = any(store.check([g]) for g in guesses)
        print(json.dumps({{"found": found, "keys": keys, "verdict": verdict, "value": value}}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert seen["found"] is False
    assert not any(k.startswith(("ctxpar/0/", "/ctxpar/0/")) for k in seen["keys"]), seen["keys"]
    assert seen["verdict"], seen["keys"]  # the handshake's keys are there, under the secret prefix
    value = bytes.fromhex(seen["value"])
    assert len(value) == 32 + 2 and value.endswith(b"go")  # "go" behind its tag: a bare "go" is refused
    # A rank's view of a value forged at a real key name: refused, naming the key.
    server = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
    server.set(seen["verdict"][0], "go")
    signed = SignedStore(server, llm.engine.executor.launch.secret)
    with pytest.raises(Unauthenticated, match="failed authentication"):
        signed.get(seen["verdict"][0])


@pytest.mark.multiprocess
@pytest.mark.parametrize("shm", [True, False], ids=["shared-pages", "gloo"])
@pytest.mark.parametrize("how", ["forged", "tampered"])
def test_a_forged_plan_is_refused_before_it_is_unpickled(tmp_path, shm, how):
    """The attack: write a step plan into the ranks' channel whose pickle creates a
    file when loaded (it could run any code). Without the secret its header's tag is
    wrong; swapped in under a genuine header and tag, its payload's tag is. Either
    way the rank refuses it, saying why, and the file is never created."""
    target = tmp_path / "pwned"
    verdict, text = run_plan_attack(shm, how, target)
    assert verdict == "refused", text
    assert "failed authentication" in text and "rank 0" in text
    assert ("header" in text) == (how == "forged")
    assert not target.exists()


def test_a_tampered_or_replayed_message_fails_its_check():
    """The same checks without processes: a flipped payload byte, a message replayed
    at another place of the stream, a header from another secret, launch or generation."""
    ctx = context(b"launch nonce", b"g0/")
    sender, receiver = PlanSeal(SECRET, ctx), PlanSeal(SECRET, ctx)
    first = sender.seal(b"plan 0")
    second = sender.seal(b"plan 1")
    assert receiver.open_header(first[0]) == len(first[1])
    assert receiver.open_payload(first[1]) == b"plan 0"
    with pytest.raises(Unauthenticated):
        receiver.open_header(first[0])  # replayed as message 1
    assert receiver.open_header(second[0]) == len(second[1])
    with pytest.raises(Unauthenticated):
        receiver.open_payload(second[1][:-1] + b"2")
    for other in (PlanSeal(b"another secret", ctx), PlanSeal(SECRET, context(b"another launch's nonce", b"g0/"))):
        with pytest.raises(Unauthenticated):
            other.open_header(first[0])
    with pytest.raises(Unauthenticated):
        PlanSeal(SECRET, context(b"launch nonce", b"g1/")).open_header(first[0])  # another generation


@pytest.mark.multiprocess
def test_an_engine_worker_sent_a_forged_plan_leaves_with_a_clear_error(tiny_model_dirs, capfd):
    """The attack on a live engine: its next plan arrives under a key other than the
    launch's (as anything that writes into the channel without the secret sends it).
    The worker refuses it and leaves, saying why; the step fails with a RankFailure
    naming the rank and the reason instead of running what it was sent."""
    with LLM(str(tiny_model_dirs["llama"]), pcp_size=2, num_threads=1, max_rank_recoveries=0) as llm:
        prompt = [{"prompt_token_ids": list(range(20))}]
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # serving
        group = llm.engine.executor.group
        forger = PlanSeal(b"not the launch secret", context(b"", b"g0/"))
        forger.seq = group.seal.seq
        group.seal = forger
        with pytest.raises(RankFailure, match="rank 1 exited with code 1, after refusing a forged message") as e:
            llm.generate(prompt, GREEDY, use_tqdm=False)
        assert "failed authentication" in str(e.value)
    err = capfd.readouterr().err
    assert "ctxpar: PCP rank 1: PCP message" in err and "failed authentication" in err, err[-2000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["forged key", "world-writable file"])
def test_a_worker_maps_no_segment_it_was_pointed_at(tmp_path, how):
    """The attack: point a worker at a file of the attacker's (world-writable, so
    the attacker could write the plans it then reads) through the ``shm/`` key.
    A value forged on the store fails its tag; a genuine name (the check behind the
    check) of a file that is not a private segment is refused too."""
    ctx = mp.get_context("spawn")
    store = host_store("127.0.0.1", 0)
    bait = SHM_DIR / f"ctxpar-bait-{os.getpid()}"
    bait.write_bytes(bytes(SEGMENT_BYTES))
    os.chmod(bait, 0o666)
    results = ctx.Queue()
    victim = ctx.Process(target=segment_victim, args=(store.port, results))
    victim.start()
    try:
        writer = store if how == "forged key" else SignedStore(store, SECRET)
        dist.PrefixStore(PREFIX, writer).set("shm/channel", str(bait))
        verdict, text = results.get(timeout=60)
    finally:
        victim.join(timeout=30)
        if victim.is_alive():
            victim.kill()
        bait.unlink()
    assert verdict == "refused", text
    want = "failed authentication" if how == "forged key" else "its mode is 0666, not 0600"
    assert want in text and (how == "forged key" or str(bait) in text)


@pytest.fixture
def segment(tmp_path):
    """A private segment of 4096 bytes, as rank 0 creates one (in tmp_path, standing in for /dev/shm)."""
    path = tmp_path / "ctxpar-segment"
    fd = create_private(path)
    os.ftruncate(fd, 4096)
    os.close(fd)
    return path


def test_segments_are_created_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        fd = create_private(tmp_path / "s")
    finally:
        os.umask(old)
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o600
    (tmp_path / "there").write_text("x")
    with pytest.raises(FileExistsError):
        create_private(tmp_path / "there")  # never an existing file
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    with pytest.raises(FileExistsError):
        create_private(tmp_path / "link")  # nor through a symlink
    assert not (tmp_path / "elsewhere").exists()


def test_a_private_segment_opens(segment):
    os.close(open_private(segment, 4096, segment.parent))


@pytest.mark.parametrize(
    "attack,why",
    [
        ("symlink", "it is a symlink"),
        ("other user's", f"it belongs to uid {NOBODY}"),
        ("world-writable", "its mode is 0666"),
        ("group-readable", "its mode is 0640"),
        ("wrong size", "it has 8192 bytes, not the 4096 agreed"),
        ("fifo", "it is not a regular file"),
        ("outside the directory", "it is not in"),
    ],
)
def test_a_substituted_segment_is_refused(segment, tmp_path, attack, why):
    """The attack: put something else where a rank will map a segment: a symlink to
    a file of the victim's (which the rank would overwrite), a file of another user
    or one others can read or write (its contents are theirs), one of another size
    (SIGBUS, or reads past its end), a FIFO (a hang)."""
    path, directory = segment, segment.parent
    if attack == "symlink":
        target = tmp_path / "victim's file"
        target.write_bytes(bytes(4096))
        os.chmod(target, 0o600)
        path.unlink()
        os.symlink(target, path)
    elif attack == "other user's":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, NOBODY, NOBODY)
    elif attack == "world-writable":
        os.chmod(path, 0o666)
    elif attack == "group-readable":
        os.chmod(path, 0o640)
    elif attack == "wrong size":
        os.truncate(path, 8192)
    elif attack == "fifo":
        path.unlink()
        os.mkfifo(path, 0o600)
    else:
        directory = tmp_path / "elsewhere"
    with pytest.raises(UnsafeFile, match="refusing to map the shared segment") as refused:
        open_private(path, 4096, directory)
    assert why in str(refused.value)


@pytest.mark.parametrize(
    "env,problem",
    [
        ({}, "need a shared secret, and none is set"),
        ({"CTXPAR_CLUSTER_SECRET": "short"}, "is 5 characters; use at least 32"),
        ({"CTXPAR_CLUSTER_SECRET": "s" * 32, "CTXPAR_CLUSTER_SECRET_FILE": "/x"}, "set one"),
        ({"CTXPAR_INSECURE_CLUSTER": "0"}, "need a shared secret"),
    ],
)
def test_a_cluster_without_a_usable_secret_is_refused(monkeypatch, env, problem):
    for name in ("CTXPAR_CLUSTER_SECRET", "CTXPAR_CLUSTER_SECRET_FILE", "CTXPAR_INSECURE_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(CtxparError, match=problem):
        cluster_secret()


@pytest.mark.parametrize(
    "attack,problem",
    [
        ("readable by others", "has mode 0644: others may read or change it"),
        ("other user's", f"belongs to uid {NOBODY}"),
        ("symlink", "a symlink is refused"),
    ],
)
def test_a_secret_file_others_could_read_or_replace_is_refused(monkeypatch, tmp_path, attack, problem):
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    os.chmod(path, 0o600)
    if attack == "readable by others":
        os.chmod(path, 0o644)
    elif attack == "other user's":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, NOBODY, NOBODY)
    else:
        os.symlink(path, tmp_path / "link")
        path = tmp_path / "link"
    monkeypatch.delenv("CTXPAR_CLUSTER_SECRET", raising=False)
    monkeypatch.setenv("CTXPAR_CLUSTER_SECRET_FILE", str(path))
    with pytest.raises(CtxparError, match=problem):
        cluster_secret()


def test_a_cluster_secret_comes_from_the_environment_or_a_private_file(monkeypatch, tmp_path):
    """The ranks key their tags with a stretch of the secret (scrypt), never the secret itself."""
    secret = "9f2c41d07be85a36e1c4f0a97d2b6e58c3a1f94e07d6b2c85e3f1a0d94b7c62e"
    monkeypatch.setenv("CTXPAR_CLUSTER_SECRET", f" {secret} \n")
    assert cluster_secret() == stretch(secret.encode()) != secret.encode()
    monkeypatch.delenv("CTXPAR_CLUSTER_SECRET")
    path = tmp_path / "secret"
    path.write_text(secret[::-1] + "\n")
    os.chmod(path, 0o600)
    monkeypatch.setenv("CTXPAR_CLUSTER_SECRET_FILE", str(path))
    assert cluster_secret() == stretch(secret[::-1].encode())
    monkeypatch.delenv("CTXPAR_CLUSTER_SECRET_FILE")
    monkeypatch.setenv("CTXPAR_INSECURE_CLUSTER", "1")
    with pytest.warns(UserWarning, match="not authenticated"):
        assert cluster_secret() == b""


@pytest.mark.multiprocess
def test_torchrun_without_a_secret_refuses_to_start(tiny_model_dirs, tmp_path):
    """The ranks of a torchrun job with no shared secret would take orders from
    anyone who reaches the rendezvous port: every rank refuses before loading
    the model, with one line naming the fix, and nothing is generated."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPAR_CLUSTER_SECRET")}
    env.update(OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    env.pop("CTXPAR_INSECURE_CLUSTER", None)
    model = str(with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path / "llama"))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "ctxpar.cli", "generate", "--model", model, "--prompt", "Hello", "--max-tokens", "2", "--pcp", "2",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode != 0
    assert done.stdout.strip() == ""
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert 1 <= len(errors) <= 2, done.stderr[-3000:]
    for line in errors:
        assert "ranks started by torchrun need a shared secret" in line and "CTXPAR_CLUSTER_SECRET" in line
    assert "CtxparError" not in done.stderr  # no rank printed a traceback (torchrun prints its own summary)
