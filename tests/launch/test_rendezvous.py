"""Several machines: launchers meet at node 0's TCPStore and agree on one cluster.

In-process tests join from threads (one TCPStore server, several clients); the end-to-end tests start
two real launchers on 127.0.0.1 and, where `ip netns` works (root), on two network namespaces joined by
a veth pair, where the tasks run a real gloo all-reduce across the "machines".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conveyor.cluster import ClusterSpec
from conveyor.launch import RendezvousError, free_ports, join

pytestmark = pytest.mark.multiprocess

SECRET = bytes(range(32, 64))
SECRET_HEX = SECRET.hex()
SETTINGS = {"strategy": None, "chief": False, "max_restarts": 3, "resume": True, "timeout": 20.0}


def join_all(endpoint: str, nodes: list[dict], timeout: float = 20.0) -> list:
    """Join every node from its own thread; return each node's Rendezvous or the exception it raised."""
    def one(kwargs):
        args = dict(nnodes=len(nodes), workers=1, ps=0, settings=SETTINGS, secret=SECRET, timeout=timeout)
        args.update(kwargs)
        try:
            return join(endpoint, **args)
        except Exception as e:  # returned, so that every thread's outcome can be checked
            return e

    with ThreadPoolExecutor(len(nodes)) as pool:
        return list(pool.map(one, nodes))


def close(results) -> None:
    for r in reversed(results):  # node 0 last: it hosts the store
        if not isinstance(r, Exception):
            r.peers.close(wait=False)


def test_nodes_agree_on_one_cluster_master_and_secret():
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    secret = bytes(range(32))
    results = join_all(endpoint, [dict(node_rank=0, workers=2, ps=1, secret=secret),
                                  dict(node_rank=1, workers=1, ps=1, secret=secret)])
    try:
        assert not [r for r in results if isinstance(r, Exception)], results
        node0, node1 = results
        assert node0.nodes == node1.nodes
        assert [(n.host, n.workers, n.ps, len(n.ports)) for n in node0.nodes] == \
            [("127.0.0.1", 2, 1, 3), ("127.0.0.1", 1, 1, 2)]
        assert (node0.node_rank, node1.node_rank) == (0, 1)
        assert node0.master_addr == node1.master_addr == "127.0.0.1"
        assert node0.master_port == node1.master_port
        assert node0.master_port not in [p for n in node0.nodes for p in n.ports]
        assert node0.secret == node1.secret == secret
    finally:
        close(results)


def test_a_node_rank_taken_twice_is_refused():
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    results = join_all(endpoint, [dict(node_rank=0), dict(node_rank=1)])
    try:
        with pytest.raises(RendezvousError, match=f"node rank 1 is taken at the rendezvous {endpoint}"):
            join(endpoint, nnodes=2, node_rank=1, workers=1, ps=0, settings=SETTINGS, secret=SECRET, timeout=5)
    finally:
        close(results)


def test_settings_that_differ_between_nodes_are_refused_naming_the_flag():
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    results = join_all(endpoint, [dict(node_rank=0), dict(node_rank=1, settings={**SETTINGS, "strategy": "pipeline"})])
    try:
        for r in results:
            assert isinstance(r, RendezvousError)
            assert "node 1 has --strategy = 'pipeline' but node 0 has None" in str(r)
    finally:
        close(results)



def test_every_node_publishes_the_pipeline_flags_so_two_different_cuts_are_refused():
    from conveyor.cli.run import node_settings
    from conveyor.launch import RunOptions

    def options(microbatches: int) -> RunOptions:
        return RunOptions(script="train.py", data_dir="/data", output_dir="/out", workers=2, strategy="pipeline",
                          stages=2, microbatches=microbatches)

    mine = node_settings(options(4))
    assert {"stages": 2, "microbatches": 4, "schedule": None, "split": None}.items() <= mine.items()
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    theirs = node_settings(options(8))
    results = join_all(endpoint, [dict(node_rank=0, settings=mine), dict(node_rank=1, settings=theirs)])
    try:
        for r in results:
            assert isinstance(r, RendezvousError)
            assert "node 1 has --microbatches = 8 but node 0 has 4; start every node with the same" in str(r)
    finally:
        close(results)

def test_secret_files_must_hold_the_same_secret():
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    results = join_all(endpoint, [dict(node_rank=0, secret=b"a" * 32), dict(node_rank=1, secret=b"b" * 32)])
    try:
        # Each node checks every record's HMAC: node 0 refuses node 1's record as node 1 refuses node 0's.
        for r in results:
            assert isinstance(r, RendezvousError) and "give every node the same --job-secret-file" in str(r)
    finally:
        close(results)


def test_a_missing_node_times_out_naming_the_address_and_the_node():
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    started = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        join(endpoint, nnodes=3, node_rank=0, workers=1, ps=0, settings=SETTINGS, secret=SECRET, timeout=0.5)
    assert time.monotonic() - started < 5
    assert f"rendezvous at {endpoint}: node(s) 1, 2 of 3 did not join within 0.5 s" in str(info.value)


def test_a_node_that_falls_silent_is_declared_lost_naming_its_rank_and_host():
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    results = join_all(endpoint, [dict(node_rank=0), dict(node_rank=1)], timeout=3.0)
    try:
        assert not [r for r in results if isinstance(r, Exception)], results
        silenced = time.monotonic()
        results[1].peers._heart.stop()  # as if its machine died: no more heartbeats, and it never leaves
        deadline = silenced + 20
        while results[1].peers.aborted() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        reason = results[0].peers.aborted()
        assert reason is not None and time.monotonic() - silenced > 2.5  # --timeout 3: not before
        assert "lost node 1 (" in reason and "at 127.0.0.1): no heartbeat from its launcher" in reason, reason
    finally:
        close(results)


def test_a_node_that_left_is_never_declared_lost():
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    results = join_all(endpoint, [dict(node_rank=0), dict(node_rank=1)], timeout=1.0)
    try:
        assert not [r for r in results if isinstance(r, Exception)], results
        results[1].peers.close()  # done with the job: it stops beating after saying so
        until = time.monotonic() + 3.0  # three times the time a silent node has
        while time.monotonic() < until:
            assert results[0].peers.aborted() is None
            time.sleep(0.1)
    finally:
        close(results)


def test_an_unreachable_rendezvous_names_the_address():
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(RendezvousError, match=f"node 1 could not reach the rendezvous at {endpoint}"):
        join(endpoint, nnodes=2, node_rank=1, workers=1, ps=0, settings=SETTINGS, secret=SECRET, timeout=0.5)


# -- two real launchers -----------------------------------------------------------------------------


REPORT = """
    import hashlib, pathlib, time
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "CONVEYOR_RESTART_COUNT"]
    seen = {k: os.environ[k] for k in keys}
    seen["secret"] = hashlib.sha256(os.environ["CONVEYOR_JOB_SECRET"].encode()).hexdigest()
    print("REPORT " + json.dumps(seen))
    attempt = os.environ["CONVEYOR_RESTART_COUNT"]
    pathlib.Path(f"reported-{attempt}-{os.environ['RANK']}").touch()
    if os.environ["RANK"] == "3" and attempt == "0":
        # fail once, after every task has reported: then both nodes must restart
        deadline = time.monotonic() + 20
        while len(list(pathlib.Path().glob("reported-0-*"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        sys.exit(5)
"""


def start_node(tmp_path: Path, rank: int, endpoint: str, *extra: str, prefix: tuple[str, ...] = (),
               env: dict | None = None) -> subprocess.Popen:
    out = open(tmp_path / f"node{rank}.out", "w")
    err = open(tmp_path / f"node{rank}.err", "w")
    with out, err:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "conveyor.cli.main", "run", "--nnodes", "2", "--node-rank", str(rank),
             "--rdzv", endpoint, "--output-dir", str(tmp_path / f"output{rank}"), "--timeout", "30", *extra,
             "task.py"],
            cwd=tmp_path, stdout=out, stderr=err, env={**os.environ, "CONVEYOR_JOB_SECRET": SECRET_HEX, **(env or {})})


def finish(procs: list[subprocess.Popen], tmp_path: Path, timeout: float = 60) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(code, (tmp_path / f"node{i}.out").read_text(), (tmp_path / f"node{i}.err").read_text())
            for i, code in enumerate(codes)]


def test_a_node_with_another_script_or_arguments_is_refused_naming_it():
    from conveyor.cli.run import node_settings
    from conveyor.launch import RunOptions

    def settings(script: str, *args: str) -> dict:
        return node_settings(RunOptions(script=script, script_args=args, data_dir="/d", output_dir="/o", workers=1))

    assert settings("train.py", "--epochs", "2") == settings("train.py", "--epochs", "2")
    for theirs, what in ((settings("other.py", "--epochs", "2"), "the training script 'other.py'"),
                         (settings("train.py", "--epochs", "3"), "the script's arguments (sha256)")):
        endpoint = f"127.0.0.1:{free_ports(1)[0]}"
        mine = settings("train.py", "--epochs", "2")
        results = join_all(endpoint, [dict(node_rank=0, settings=mine), dict(node_rank=1, settings=theirs)])
        try:
            for r in results:
                assert isinstance(r, RendezvousError), r
                assert f"node 1 runs {what}" in str(r) and "start every node with the same script and" in str(r)
        finally:
            close(results)


class SilentStore:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers: node 0 cut off mid-job."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        with contextlib.suppress(OSError):
            while True:
                self.held.append(self.server.accept()[0])

    def close(self):
        for c in [self.server, *self.held]:
            c.close()


def test_a_store_that_never_answers_ends_the_join_within_the_timeout_naming_node_0():
    silent = SilentStore()
    try:
        started = time.monotonic()
        with pytest.raises(RendezvousError) as info:
            join(silent.endpoint, nnodes=2, node_rank=1, workers=1, ps=0, settings=SETTINGS, secret=SECRET,
                 timeout=2.0)
        assert time.monotonic() - started < 8  # torch's own client would wait for ever
        message = str(info.value)
        assert f"rendezvous store at {silent.endpoint} did not answer within" in message
        assert f"check that this node reaches {silent.endpoint}" in message
    finally:
        silent.close()


def test_every_store_call_of_the_peers_has_the_job_timeout():
    from conveyor.errors import PeerError
    from conveyor.launch.rendezvous import StorePeers

    blocked = threading.Event()

    class Hung:  # a store whose link was cut after the rendezvous: every call blocks
        def __getattr__(self, name):
            return lambda *args: blocked.wait(60)

    peers = StorePeers(Hung(), nnodes=2, node_rank=1, endpoint="10.9.9.9:29500", timeout=0.5, secret=SECRET)
    for call in (lambda: peers.failure(0), lambda: peers.report_failure(0, "x"), lambda: peers.beat(1),
                 lambda: peers.beat_of(0), lambda: peers.all_done(0), lambda: peers.report_done(0)):
        started = time.monotonic()
        with pytest.raises(PeerError, match=r"rendezvous store at 10\.9\.9\.9:29500 did not answer within 0\.5 s"):
            call()
        assert time.monotonic() - started < 3
    blocked.set()


@pytest.mark.serial  # asserts the launcher ends within 30 s of a 3 s --timeout: wall time, not CPU
def test_a_launcher_cut_off_from_node_0_ends_within_its_timeout(tmp_path):
    (tmp_path / "task.py").write_text("print('never started')\n")
    silent = SilentStore()
    try:
        started = time.monotonic()
        proc = start_node(tmp_path, 1, silent.endpoint, "-n", "1", "--timeout", "3")
        try:
            code = proc.wait(timeout=40)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err = (tmp_path / "node1.err").read_text()
        assert code != 0 and time.monotonic() - started < 30, err
        assert f"rendezvous store at {silent.endpoint} did not answer within" in err, err
    finally:
        silent.close()


def test_two_launchers_on_one_host_agree_and_restart_together(tmp_path):
    (tmp_path / "task.py").write_text("import os, sys, json\n" + textwrap.dedent(REPORT))
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    procs = [start_node(tmp_path, rank, endpoint, "-n", "2") for rank in (1, 0)]  # node 1 first: it must wait
    results = finish(procs[::-1], tmp_path)
    for code, _, err in results:
        assert code == 0, err
    reports = [json.loads(line.split("REPORT ", 1)[1]) for _, out, _ in results for line in out.splitlines()
               if "REPORT " in line]
    assert len(reports) == 8  # 4 tasks x 2 attempts
    assert sorted((r["CONVEYOR_RESTART_COUNT"], r["RANK"]) for r in reports) == \
        [(a, str(r)) for a in "01" for r in range(4)]
    spec = ClusterSpec.from_tf_config(reports[0]["TF_CONFIG"])
    assert spec.world_size == 4
    for r in reports:
        assert ClusterSpec.from_tf_config(r["TF_CONFIG"]) == spec
        assert json.loads(r["TF_CONFIG"])["task"] == {"type": "worker", "index": int(r["RANK"])}
        assert (r["WORLD_SIZE"], r["LOCAL_RANK"]) == ("4", str(int(r["RANK"]) % 2))
        assert (r["MASTER_ADDR"], r["MASTER_PORT"], r["secret"]) == \
            ("127.0.0.1", reports[0]["MASTER_PORT"], reports[0]["secret"])
    assert "worker:3 exited with status 5 on node 1" in results[0][2]  # node 0 restarted for node 1's task
    assert (tmp_path / "output1" / "logs" / "worker-3.log").exists()
    assert not (tmp_path / "output0" / "logs" / "worker-3.log").exists()
    # the restart's record (summary.json's recovery): node 0 alone writes it, as an output folder may be shared
    (record,) = json.loads((tmp_path / "output0" / "logs" / "restarts.json").read_text())
    assert record["attempt"] == 1 and record["seen"] <= record["stopped"] <= record["started"], record
    assert not (tmp_path / "output1" / "logs" / "restarts.json").exists()


# -- two network namespaces -------------------------------------------------------------------------

EXCHANGE = """
    # Worker 0 listens where torch's store would (MASTER_ADDR:MASTER_PORT), worker 1 at its TF_CONFIG address;
    # each connects to the other across the namespaces: both kinds of address must be reachable.
    import socket, time
    from conveyor.cluster import discover, split_address
    me = discover()
    master, worker1 = (me.master_addr, me.master_port), split_address(me.spec.task_address("worker", 1))
    mine, theirs = (master, worker1) if me.rank == 0 else (worker1, master)
    server = socket.create_server(mine)
    server.settimeout(20)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(theirs, timeout=2) as c:
                c.sendall(f"hello from rank {me.rank}".encode())
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    conn, (addr, _) = server.accept()
    print(f"rank {me.rank} of {me.world_size} got {conn.recv(100).decode()!r} from {addr}; master {me.master_addr}")
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_namespaces():
    """Two network namespaces joined by a veth pair, at 10.231.<n>.1 and .2; skips where they cannot be made."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = os.getpid() % 100000
    subnet = f"10.231.{tag % 250}"
    nodes = [(f"cvA{tag}", f"va{tag}", f"{subnet}.1"), (f"cvB{tag}", f"vb{tag}", f"{subnet}.2")]
    try:
        for ns, _, _ in nodes:
            _ip("netns", "add", ns)
        _ip("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for ns, dev, address in nodes:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.SubprocessError, OSError) as e:
        for ns, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        detail = e.stderr.decode().strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        pytest.skip(f"cannot make network namespaces here: {detail}")
    try:
        yield [(ns, address) for ns, _, address in nodes]
    finally:
        for ns, _, _ in nodes:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_two_launchers_in_two_network_namespaces_reach_each_other(tmp_path, two_namespaces):
    (tmp_path / "task.py").write_text(textwrap.dedent(EXCHANGE))
    (ns0, addr0), (ns1, addr1) = two_namespaces
    endpoint = f"{addr0}:29400"
    procs = [start_node(tmp_path, rank, endpoint, prefix=("ip", "netns", "exec", ns))
             for rank, ns in ((0, ns0), (1, ns1))]
    results = finish(procs, tmp_path, timeout=60)
    for code, _, err in results:
        assert code == 0, err
    assert f"[worker:0] rank 0 of 2 got 'hello from rank 1' from {addr1}; master {addr0}" in results[0][1]
    assert f"[worker:1] rank 1 of 2 got 'hello from rank 0' from {addr0}; master {addr0}" in results[1][1]


# -- what crosses the network -----------------------------------------------------------------------


def test_the_store_listens_only_on_the_rdzv_address():
    import psutil

    port = free_ports(1)[0]
    results = join_all(f"127.0.0.1:{port}", [dict(node_rank=0, secret=b"k" * 32), dict(node_rank=1, secret=b"k" * 32)])
    try:
        assert not [r for r in results if isinstance(r, Exception)], results
        listening = {c.laddr.ip for c in psutil.Process().net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening == {"127.0.0.1"}
    finally:
        close(results)


def test_the_secret_is_never_published_in_the_store():
    from datetime import timedelta

    from torch.distributed import TCPStore

    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    secret = bytes(range(100, 132))
    results = join_all(endpoint, [dict(node_rank=0, secret=secret), dict(node_rank=1, secret=secret)])
    try:
        assert not [r for r in results if isinstance(r, Exception)], results
        host, port = endpoint.rsplit(":", 1)
        intruder = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))  # no credentials needed
        published = [intruder.get(key) for key in ("conveyor/job", "conveyor/node/0", "conveyor/node/1")]
        for value in published:
            assert secret.hex() not in value.decode() and secret not in value
    finally:
        close(results)


def test_a_node_without_the_secret_cannot_join():
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    results = join_all(endpoint, [dict(node_rank=0, secret=b"a" * 32), dict(node_rank=1, secret=None)], timeout=1.0)
    try:
        assert isinstance(results[1], ValueError) and "secret" in str(results[1])
    finally:
        close(results)


# -- the coordination keys are signed too -------------------------------------------------------------------------


def intruder_of(endpoint: str):
    """A raw TCPStore client without the secret: what anyone who reaches the port can do."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, port = endpoint.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))


def forge(store) -> None:
    """Everything that used to stop, restart or finish a job: plain values and inflated counters."""
    store.set("conveyor/abort", "forged: stop the job")
    store.set("conveyor/failed/0", "forged: restart the job")
    store.set("conveyor/succeeded/0", json.dumps({"node": 0}) + "\n" + "0" * 64)  # "the chief finished"
    for key in ("conveyor/done/0", "conveyor/stopped/0", "conveyor/left"):
        store.add(key, 10)
    for r in range(2):  # and the per-node keys, with something that is not a record
        for key in (f"conveyor/done/0/{r}", f"conveyor/stopped/0/{r}", f"conveyor/left/{r}"):
            store.set(key, json.dumps({"node": r}) + "\n" + "0" * 64)


def test_forged_coordination_keys_neither_stop_restart_nor_finish_the_job(capsys):
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    results = join_all(endpoint, [dict(node_rank=0), dict(node_rank=1)])
    try:
        assert not [r for r in results if isinstance(r, Exception)], results
        node0, node1 = (r.peers for r in results)
        forge(intruder_of(endpoint))
        for peers in (node0, node1):
            assert peers.aborted() is None and peers.failure(0) is None
            assert not peers.all_done(0) and not peers.all_stopped(0) and not peers.succeeded(0)
        for peers in (node0, node1):
            peers.aborted(), peers.failure(0)  # asked again: said once only
        err = capsys.readouterr().err
        assert err.count("conveyor/abort") == 2 and err.count("conveyor/failed/0") == 2  # once per node
        assert "not signed with this job's secret" in err

        # the nodes' own reports still count, and replace a forgery that took their place
        node1.report_failure(0, "worker:1 exited with status 3 on node 1")
        assert node0.failure(0) == node1.failure(0) == "worker:1 exited with status 3 on node 1"
        node0.report_failure(0, "a later failure")  # the first failure wins
        assert node0.failure(0) == "worker:1 exited with status 3 on node 1"
        node0.report_done(0)
        assert not node0.all_done(0)
        node1.report_done(0)
        assert node0.all_done(0) and node1.all_done(0)
        node0.report_stopped(0), node1.report_stopped(0)
        assert node0.all_stopped(0) and node1.all_stopped(0)
        node0.report_succeeded(0)  # the chief's node: the serving tasks elsewhere may stop
        assert node1.succeeded(0) and not node1.succeeded(1)
        node0.abort("node 0's launcher was stopped by SIGINT")
        assert node1.aborted() == "node 0's launcher was stopped by SIGINT"
    finally:
        close(results)


def test_node0_keeps_the_store_until_the_others_left_whatever_the_counter_says():
    import threading

    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    results = join_all(endpoint, [dict(node_rank=0), dict(node_rank=1)])
    try:
        assert not [r for r in results if isinstance(r, Exception)], results
        forge(intruder_of(endpoint))
        leave = threading.Timer(1.0, results[1].peers.close)
        leave.start()
        started = time.monotonic()
        results[0].peers.close(wait=True, linger=10)  # a forged "left" must not make it go at once
        assert 0.8 < time.monotonic() - started < 8
        leave.join()
    finally:
        close(results)


def test_a_signed_key_of_another_job_with_the_same_secret_is_not_accepted(capsys):
    # The secret file is usually reused from job to job: a record copied from an earlier job replays nothing.
    first = f"127.0.0.1:{free_ports(1)[0]}"
    earlier = join_all(first, [dict(node_rank=0), dict(node_rank=1)])
    try:
        earlier[1].peers.abort("an earlier job's abort")
        recorded = intruder_of(first).get("conveyor/abort")
    finally:
        close(earlier)
    second = f"127.0.0.1:{free_ports(1)[0]}"
    results = join_all(second, [dict(node_rank=0), dict(node_rank=1)])
    try:
        assert not [r for r in results if isinstance(r, Exception)], results
        intruder_of(second).set("conveyor/abort", recorded)
        assert results[0].peers.aborted() is None and results[1].peers.aborted() is None
        assert "conveyor/abort" in capsys.readouterr().err
    finally:
        close(results)


WAIT_FOR_GO = """
    import os, pathlib, time
    attempt, rank = os.environ["CONVEYOR_RESTART_COUNT"], os.environ["RANK"]
    pathlib.Path(f"started-{attempt}-{rank}").touch()
    deadline = time.monotonic() + 30
    while not pathlib.Path("go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"FINISHED attempt {attempt} rank {rank}")
"""


def test_a_client_without_the_secret_cannot_stop_or_restart_two_launchers(tmp_path):
    (tmp_path / "task.py").write_text(textwrap.dedent(WAIT_FOR_GO))
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    procs = [start_node(tmp_path, rank, endpoint, "-n", "1") for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 40
        while len(list(tmp_path.glob("started-0-*"))) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the tasks did not start"
            time.sleep(0.05)
        forge(intruder_of(endpoint))
        time.sleep(1.5)  # several of the supervisors' peer polls (0.2 s): a forged abort would have stopped them
        assert all(p.poll() is None for p in procs)
    finally:
        (tmp_path / "go").touch()
    results = finish(procs, tmp_path)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"FINISHED attempt 0 rank {rank}" in out and "attempt 1" not in out + err
        assert err.count("conveyor/abort") == 1, err  # ignored, and said once
