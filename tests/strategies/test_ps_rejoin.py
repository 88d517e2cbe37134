"""A ps-async (or ps-ssp) worker killed with SIGKILL is replaced alone: the ps and the other worker go on, and the
replacement redoes exactly what the servers did not apply — every record's update applied once.

The model is one parameter with an element per record id, trained with SGD at lr 1 on a loss whose gradient is
the batch's one-hot: each application of a record's update subtracts 1 from its element, so at the end every
element must be exactly -1 (0: skipped, -2: applied twice). The parameter is cut into four pieces over two ps
tasks and every piece is its own push, so a step's update can be half applied when its worker dies. Worker 1
runs in its own process and dies at the worst moments we can name: right after its pushes reached the servers
(before any commit), and between its commit to ps:0 and its commit to ps:1 (the servers then disagree by one
step); and by a SIGKILL from outside at a random step. The test plays the launcher: it starts the replacement
only after seeing the death, and checks that worker 0 kept committing meanwhile.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from conveyor.launch.ports import free_ports
from conveyor.strategies.ps.applied import AppliedLog
from conveyor.strategies.ps.server import ParameterServer

SECRET = b"ps-rejoin-test-secret"
IDS = 240  # records; worker r trains ids r, r + 2, ... in batches of 2: 60 steps each
DIE_AT = 12  # the step worker 1 dies in

_WORKER = f"""
import json, os, signal, sys, time, torch
from conveyor.strategies.ps.client import PSClient
addresses, rank, fault, delay = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
model = torch.nn.Module()
model.w = torch.nn.Parameter(torch.zeros({IDS}))
client = PSClient(addresses, {SECRET!r}, rank=rank, num_workers=2, sender=f"worker:{{rank}}", timeout=60.0,
                  chunk_bytes=4 * {IDS} // 4, bucket_bytes=8)
client.connect(model, torch.optim.SGD(model.parameters(), lr=1.0))
start = 0
if fault == "rejoin":
    position = client.rejoin()
    start = json.loads(position)["next"] if position is not None else 0
    print("rejoined at", client.step, "from batch", start, flush=True)
mine = list(range(rank, {IDS}, 2))
batches = [mine[i:i + 2] for i in range(0, len(mine), 2)]
send = client._send

def send_then_die(server, request):  # the commit reaches ps:0; the process dies before ps:1's is sent
    rid = send(server, request)
    if type(request).__name__ == "Commit" and request.step == {DIE_AT} and server == 0:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    return rid

if fault == "between_commits":
    client._send = send_then_die
for b in range(start, len(batches)):
    onehot = torch.zeros({IDS})
    onehot[batches[b]] = 1.0
    client.finish_pull()
    model.zero_grad()
    (model.w * onehot).sum().backward()  # every piece is pushed from the hook as backward makes it
    if fault == "after_pushes" and client.step == {DIE_AT}:
        time.sleep(0.3)  # the pushes are applied; the commit never leaves
        os.kill(os.getpid(), signal.SIGKILL)
    client.position = json.dumps({{"next": b + 1}}).encode()
    client.finish_step(prefetch=True)
    print("step", client.step, flush=True)
    time.sleep(delay)
client.close()
"""


def _worker(addresses: str, rank: int, fault: str, delay: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WORKER, addresses, str(rank), fault, str(delay)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _kill_after_step(proc: subprocess.Popen, step: int, deadline: float) -> list[str]:
    """Read worker 1's output until it said `step`, then SIGKILL it (the fault from outside)."""
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == f"step {step}":
            time.sleep(random.uniform(0.0, 0.05))  # anywhere in the next step
            proc.send_signal(signal.SIGKILL)
            break
        assert time.monotonic() < deadline, lines
    return lines


def _run(mode: str, staleness: int, fault: str) -> list[ParameterServer]:
    ports = free_ports(2)
    servers = [ParameterServer(f"127.0.0.1:{p}", SECRET, index=i, num_workers=2, mode=mode,
                               staleness=staleness).start() for i, p in enumerate(ports)]
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    deadline = time.monotonic() + 200
    w0 = _worker(addresses, 0, "none", 0.04)
    w1 = _worker(addresses, 1, "none" if fault == "outside" else fault, 0.0)
    try:
        if fault == "outside":
            _kill_after_step(w1, DIE_AT, deadline)
        out1, _ = w1.communicate(timeout=120)
        assert w1.returncode == -signal.SIGKILL, out1
        before = servers[0].clock[0]
        time.sleep(1.0)  # worker 1 is down: the ps and worker 0 go on without it (ps-async)
        during = servers[0].clock[0]
        replacement = _worker(addresses, 1, "rejoin", 0.0)
        out, _ = replacement.communicate(timeout=120)
        assert replacement.returncode == 0, out
        out0, _ = w0.communicate(timeout=120)
        assert w0.returncode == 0, out0
        if mode == "async":
            assert during > before, (before, during)
        for server in servers:
            assert server.clock[1] >= DIE_AT and server.counters["rejoins"] == 1
        return servers
    finally:
        for proc in (w0, w1):
            if proc.poll() is None:
                proc.kill()
        for server in servers:
            server.close()


def _applied_counts(servers: list[ParameterServer]) -> torch.Tensor:
    """How often each record id's update was applied: minus the parameter's elements, over every piece."""
    return -torch.cat([server.opt.params[key] for server in servers for key in server.keys])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", ["after_pushes", "between_commits", "outside"])
def test_a_ps_async_worker_killed_mid_epoch_is_replaced_alone_and_every_record_applies_once(fault: str) -> None:
    servers = _run("async", 0, fault)
    counts = _applied_counts(servers)
    assert counts.numel() == IDS and torch.equal(counts, torch.ones(IDS)), counts
    if fault == "after_pushes":  # the dead step's pieces were applied: its redo dropped them
        assert sum(s.counters["pieces_redone_dropped"] for s in servers) == len(servers[0].keys) * len(servers)
    if fault == "between_commits":  # ps:0 had the commit: the redone step was dropped there, applied on ps:1
        assert servers[0].counters["steps_redone_dropped"] >= 1 and servers[1].counters["steps_redone_dropped"] == 0


@pytest.mark.timeout(400)
def test_a_ps_ssp_worker_killed_between_its_commits_is_replaced_alone_exactly_once() -> None:
    counts = _applied_counts(_run("ssp", 2, "between_commits"))
    assert torch.equal(counts, torch.ones(IDS)), counts


def test_a_ps_sync_server_refuses_a_rejoin_naming_the_whole_job_restart() -> None:
    from conveyor.comm.transport import RemoteError
    from conveyor.strategies.ps.client import PSClient

    port = free_ports(1)[0]
    server = ParameterServer(f"127.0.0.1:{port}", SECRET, index=0, num_workers=1, mode="sync").start()
    try:
        model = torch.nn.Linear(2, 1)
        client = PSClient([f"127.0.0.1:{port}"], SECRET, rank=0, num_workers=1, sender="worker:0", timeout=30.0)
        client.connect(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(RemoteError, match="restarts the whole job"):
            client.rejoin()
        client.close()
    finally:
        server.close()


def test_the_applied_log_drops_exactly_what_a_server_applied_of_a_redone_step() -> None:
    log = AppliedLog()
    log.pushed(1, 5, ["a", "b"])  # step 5's pieces a and b applied, then worker 1 died before committing
    assert log.fresh(1, 5, {"a": 1, "c": 3}) == {"a": 1, "c": 3}  # no rejoin yet: an honest worker's push
    assert log.rejoin(1, clock=5) is None  # no position ever sent: its data starts over
    assert log.fresh(1, 5, {"a": 1, "b": 2, "c": 3}) == {"c": 3}
    assert log.duplicate(1, 4, clock=5) and not log.duplicate(1, 5, clock=5) and not log.duplicate(0, 4, clock=5)
    log.committed(1, 5, b"p5")
    assert log.fresh(1, 6, {"a": 1}) == {"a": 1} and log.positions == {1: b"p5"}
    log.committed(1, 6, None)  # the position did not change: the one kept stays
    assert log.rejoin(1, clock=7) == b"p5" and log.duplicate(1, 6, clock=7) and not log.duplicate(1, 5, clock=7)
    restored = AppliedLog()
    restored.load_json({"positions": {"1": log.to_json()["positions"]["1"], "9": "eA==", "x": 3}}, num_workers=2)
    assert restored.positions == {1: b"p5"}
    restored.load_json(None, num_workers=2)  # a shard written before the log existed
    assert restored.positions == {1: b"p5"}


@pytest.mark.timeout(120)
def test_applied_positions_travel_in_the_checkpoint_shard_and_answer_a_rejoin_after_a_restore(tmp_path) -> None:
    from conveyor.strategies.ps.client import PSClient
    from conveyor.strategies.ps.task import shard_stores
    from conveyor.train.checkpoint import CheckpointManager

    stores = shard_stores(tmp_path, CheckpointManager)
    root = str(tmp_path / "checkpoints")
    servers, clients = [], []

    def serve_and_connect(rank: int) -> tuple[PSClient, torch.nn.Module]:
        port = free_ports(1)[0]
        servers.append(ParameterServer(f"127.0.0.1:{port}", SECRET, index=0, num_workers=2, mode="async",
                                       shards=stores).start())
        model = torch.nn.Linear(2, 1)
        client = PSClient([f"127.0.0.1:{port}"], SECRET, rank=rank, num_workers=2, sender=f"worker:{rank}",
                          timeout=30.0)
        clients.append(client)
        client.connect(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return client, model

    try:
        client, model = serve_and_connect(0)
        for position in (b"p1", b"p2", b"p2"):  # the last commit carries none: unchanged
            model(torch.ones(1, 2)).sum().backward()
            client.position = position
            client.finish_step()
        assert servers[0].applied.positions == {0: b"p2"} and servers[0].clock[0] == 3
        CheckpointManager(root).finalize(7, client.save_shards(7, root))
        fresh, _ = serve_and_connect(0)  # a full restart: a fresh ps restored from the step
        fresh.restore_shards(7, root)
        assert fresh.rejoin() == b"p2" and fresh.step == 0  # the position that matches the restored parameters
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.close()


def test_meetings_on_ps0_give_every_worker_the_process_group_results() -> None:
    """The workers' collectives after training (and in a worker restarted alone) go through ps:0: each is a
    numbered meeting, answered with every worker's bytes once all are in; the reductions equal the group's."""
    import threading

    from conveyor.strategies.ps import protocol as wire
    from conveyor.strategies.ps.meetings import ServerCollectives

    port = free_ports(1)[0]
    server = ParameterServer(f"127.0.0.1:{port}", SECRET, index=0, num_workers=2, mode="async")
    try:
        assert isinstance(server._on_meet(wire.Meet(1, b"late", 0)), wire.WaitReply)  # worker 0 not there yet
        assert server._on_meet(wire.Meet(0, b"first", 0)).found == {0: b"first", 1: b"late"}
        assert server._on_meet(wire.Meet(1, b"late", 0)).found == {0: b"first", 1: b"late"}  # asked again: same
        server._on_meet(wire.Meet(0, b"x", 1))
        assert server._on_meet(wire.Meet(1, b"y", 1)).found == {0: b"x", 1: b"y"} and list(server.meetings) == [1]
    finally:
        server.close()

    class Board:  # two workers' clients meeting through one dict, as ps:0 does
        def __init__(self, rank: int, room: dict, lock: threading.Condition) -> None:
            self.rank, self.room, self.lock = rank, room, lock

        def meet(self, key: int, data: bytes) -> list[bytes]:
            with self.lock:
                self.room.setdefault(key, {})[self.rank] = data
                self.lock.notify_all()
                assert self.lock.wait_for(lambda: len(self.room[key]) == 2, timeout=10)
                return [self.room[key][r] for r in range(2)]

    room, lock, results = {}, threading.Condition(), {}

    def worker(rank: int) -> None:
        group = ServerCollectives(Board(rank, room, lock), world_size=2, rank=rank)
        group.barrier()
        results[rank] = (group.all_gather_bytes(bytes([rank]) * (rank + 1)), group.broadcast_bytes(b"chief", 0),
                         group.all_reduce(torch.tensor([1.0, 2.0 * rank]), "sum"),
                         group.all_reduce(torch.tensor([3 + rank], dtype=torch.int64), "mean"),
                         group.all_reduce(torch.tensor([[rank, -rank]], dtype=torch.float64), "max"))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rank in range(2):
        gathered, chief, total, mean, largest = results[rank]
        assert gathered == [b"\x00", b"\x01\x01"] and chief == b"chief"
        assert total.tolist() == [2.0, 2.0] and mean.tolist() == [3] and largest.tolist() == [[1.0, 0.0]]
