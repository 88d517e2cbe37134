"""Parameter-server strategies across real processes: 2 ps tasks + 2 workers on 127.0.0.1.

Each launch starts this file as a script four times (``python test_ps.py SCENARIO OUT_DIR``) with the
environment conveyor's launcher gives each task (``task_environment`` on ``local_cluster(2, 2)``): the
same code entry for every role, as ``conveyor run`` does. On a ps task ``conveyor.init()`` serves and
exits the process when the workers are done; the workers train and write what they saw to JSON.

    pytest tests/strategies/test_ps.py -m multiprocess --durations=5

Budgets: a launch takes 15-25 s on the shared 2-core development machine and 45-70 s with two more
busy processes on it (most of it four interpreters importing torch). Waits are on events (process exit,
the servers' drop counters); the limits (``LAUNCH_DEADLINE`` per launch, the job's ``TIMEOUT`` for its
rendezvous and requests) only catch hangs, and leave room for a machine at a fifth of its speed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import conveyor
from conveyor.cluster import local_cluster, task_environment
from conveyor.comm.transport import Client, RemoteError
from conveyor.launch.ports import free_ports
from conveyor.strategies import PSStrategy
from conveyor.strategies.ps import OptimizerSpec, ServerOptimizer, mean_of_gradients, place
from conveyor.strategies.ps.protocol import ParamsReply, read_reply
from conveyor.strategies.ps.server import ParameterServer
from conveyor.strategies.ps.task import shard_stores
from conveyor.train.checkpoint import CheckpointManager

WORLD = 2
NUM_PS = 2
BATCH = 8  # per worker; the single-process reference uses WORLD * BATCH
STEPS = 10
SECRET = b"ps-test-secret"
LAUNCH_DEADLINE = 240.0  # seconds for one launch's four processes to finish
TIMEOUT = 120  # the job's CONVEYOR_TIMEOUT: rendezvous, requests, and the ps tasks' idle limit
_FOREIGN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG",
            "OMP_NUM_THREADS")


# -- shared by the tasks and the reference --------------------------------------------------------------------------


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "plain":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def make_data(steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(steps * WORLD * BATCH, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(len(x), 1, generator=g)


def flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def reference(kind: str) -> list[float]:
    """One process, the combined batch of both workers, the same optimizer."""
    model = make_mlp(0)
    optimizer = make_optimizer(kind, model)
    scheduler = make_scheduler(kind, optimizer)
    x, y = make_data()
    for k in range(STEPS):
        lo = k * WORLD * BATCH
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[lo:lo + WORLD * BATCH]), y[lo:lo + WORLD * BATCH]).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return flat(model)


def make_scheduler(kind: str, optimizer: torch.optim.Optimizer):
    """SGD runs under a StepLR: the servers must follow the workers' learning-rate changes."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5) if kind == "sgd" else None


# -- the task script ------------------------------------------------------------------------------------------------


def attack(ports: list[int]) -> None:
    """Random bytes, a wrong-secret connection, and forged (badly signed) messages at every ps port; returns
    once every server has counted the forgeries (so the test sees them in the stats at the end)."""
    import zmq

    from conveyor.comm.framing import encode, next_seq, sender_id
    from conveyor.comm.transport import _password

    for port in ports:
        before = _signature_drops(port, ports.index(port))
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(os.urandom(4096))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.plain_username = b"conveyor"
        sock.plain_password = _password(SECRET)  # passes the gate; the messages themselves are forged
        sock.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(5):
            ps = f"ps:{ports.index(port)}"
            forged = encode("push", {"rank": 0, "step": 0, "keys": ["0.weight[0:64]"], "read": 0},
                            [torch.full((64,), 1e6)], secret=b"not-the-secret", sender=sender_id("worker:0"),
                            seq=next_seq(), recipient=ps)
            sock.send_multipart([bytes(f) for f in forged])
            sock.send_multipart([os.urandom(64), os.urandom(32)])
        deadline = time.monotonic() + TIMEOUT
        while _signature_drops(port, ports.index(port)) < before + 10:  # 5 forged + 5 random, all unsigned
            assert time.monotonic() < deadline, f"ps at port {port} did not count the forged messages"
            time.sleep(0.05)
        sock.close(linger=0)


def _signature_drops(port: int, index: int) -> int:
    with Client(f"127.0.0.1:{port}", SECRET, name=f"ps:{index}", timeout=TIMEOUT, sender="worker:0") as client:
        return client.request("stats").header["dropped_by_reason"].get("signature", 0)


def apart_main(job, out: Path) -> None:
    """The Trainer with ps-async and worker 1 slowed down: the workers must not wait for each other."""
    from conveyor.data import Dataset

    model = make_mlp(0)
    model, optimizer = job.prepare(model, make_optimizer("plain", model))
    x, y = make_data(20)  # 20 steps per worker per epoch
    data = Dataset.from_tensor_slices((x.numpy(), y.numpy())).shard(WORLD, job.rank).batch(BATCH, drop_remainder=True)
    slow = _Slow() if job.rank == 1 else (lambda event: None)
    held_out = Dataset.from_tensor_slices((x[:64].numpy(), y[:64].numpy())).shard(WORLD, job.rank).batch(BATCH)
    trainer = conveyor.Trainer(job, model, optimizer, nn.functional.mse_loss, data, epochs=2,
                               eval_data=held_out, metric_fn=lambda out, target: 0.0, eval_every_steps=7,
                               checkpoint_every_steps=10, callbacks=[slow], progress=False)
    summary = trainer.fit()
    params = [p.detach().flatten().tolist() for p in trainer.module.parameters()]
    (out / f"rank{job.rank}.json").write_text(json.dumps({"steps": trainer.step, "summary": summary,
                                                          "params": params}))
    job.shutdown()


class _Slow:
    """Makes worker 1's steps take three times what they compute: however loaded the machine, it runs at
    about a third of worker 0's pace (a fixed sleep would drown in the load, or on an idle machine leave
    worker 1 so far behind that it reaches no checkpoint interval before the job's last checkpoints)."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, event) -> None:
        time.sleep(2 * (time.perf_counter() - self.last))
        self.last = time.perf_counter()


def task_main(scenario: str, out: Path) -> None:
    job = conveyor.init()  # a ps task serves here and exits the process when the workers are done
    if scenario == "apart":
        return apart_main(job, out)
    kind = {"adam": "adam", "async": "plain", "ssp": "plain"}.get(scenario, "sgd")
    model = make_mlp(job.rank)  # different seeds: the servers' copy (worker 0's) must win
    optimizer = make_optimizer(kind, model)
    model, optimizer = job.prepare(model, optimizer)
    scheduler = make_scheduler(kind, optimizer)  # on the proxy, as a user would write it
    steps = 40 if scenario in ("async", "ssp") else STEPS
    x, y = make_data(steps)
    with torch.no_grad():
        first = nn.functional.mse_loss(model(x), y).item()
    losses = []
    for k in range(steps):
        lo = k * WORLD * BATCH + job.rank * BATCH
        if scenario == "garbage" and k == 3 and job.rank == 0:
            attack([int(a.rsplit(":", 1)[1]) for a in job.cluster.ps])
        if scenario == "ssp" and job.rank == 1:
            time.sleep(0.03)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[lo:lo + BATCH]), y[lo:lo + BATCH])
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    job.barrier()  # both workers' last pushes are on the servers: pull the final parameters
    if scenario in ("async", "ssp"):
        optimizer.step()  # nothing left to push: commits an empty step and pulls the latest
    with torch.no_grad():
        last = nn.functional.mse_loss(model(x), y).item()
    stats = job.strategy.stats()
    state = optimizer.state_dict()
    result = {"ok": True, "params": flat(model), "losses": losses, "first": first, "last": last, "stats": stats,
              "comm": job.strategy.step.comm_seconds(), "state_servers": len(state["servers"])}
    (out / f"rank{job.rank}.json").write_text(json.dumps(result))
    job.shutdown()


# -- launching ------------------------------------------------------------------------------------------------------


def launch(scenario: str, strategy: str, out: Path, deadline: float = LAUNCH_DEADLINE) -> tuple[list[dict], list[int]]:
    """Run SCENARIO on 2 ps + 2 workers; each worker's JSON and every process's exit code (ps last)."""
    out.mkdir(parents=True, exist_ok=True)
    ports = free_ports(WORLD + NUM_PS + 1)
    spec = local_cluster(num_workers=WORLD, num_ps=NUM_PS, ports=ports[:-1])
    from taskrun import launcher_var, wait_all  # here: this file also runs as the workers' script, outside pytest

    base = {k: v for k, v in os.environ.items() if k not in _FOREIGN and not launcher_var(k)}
    procs = []
    for i, task in enumerate((*spec.training_tasks, *(t for t in spec.tasks if t.type == "ps"))):
        env = base | task_environment(spec, task, secret=SECRET, data_dir=out / "data", output_dir=out / "output",
                                      master_addr="127.0.0.1", master_port=ports[-1], strategy=strategy,
                                      local_rank=min(i, WORLD - 1), local_world_size=WORLD)
        env["CONVEYOR_TIMEOUT"] = str(TIMEOUT)
        env["OMP_NUM_THREADS"] = "1"
        log = open(out / f"{task.type}{task.index}.log", "wb")
        procs.append((subprocess.Popen([sys.executable, __file__, scenario, str(out)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))

    wait_all(procs, deadline, f"{scenario}: tasks", lambda: logs(out))
    results = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        assert path.exists(), logs(out)
        results.append(json.loads(path.read_text()))
    return results, [proc.returncode for proc, _ in procs]


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.glob("*.log")))


# -- in-process tests of the server's rules ---------------------------------------------------------------------------


@pytest.fixture
def served():
    """A started ParameterServer factory on a free port and a client factory for it; all closed afterwards."""
    made = []

    def make(mode: str, staleness: int = 0, workers: int = 2, shards=None):
        port = free_ports(1)[0]
        server = ParameterServer(f"127.0.0.1:{port}", SECRET, index=0, num_workers=workers, mode=mode,
                                 staleness=staleness, shards=shards).start()
        clients = [Client(f"127.0.0.1:{port}", SECRET, name="ps:0", timeout=10.0, sender=f"worker:{r}")
                   for r in range(workers)]
        made.append((server, clients))
        return server, clients

    yield make
    for server, clients in made:
        for c in clients:
            c.close()
        server.close()


def _init(client: Client, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int = 0):
    placement = place([(n, p.shape, p.dtype) for n, p in model.named_parameters()], 1)
    header = {"fingerprint": placement.fingerprint, "rank": rank}
    tensors = []
    if rank == 0:
        spec = OptimizerSpec.from_optimizer(optimizer, model.named_parameters())
        header.update(spec=spec.to_json(), keys=[p.key for p in placement.pieces])
        flat_ = {n: p.detach().reshape(-1) for n, p in model.named_parameters()}
        tensors = [flat_[p.param][p.start:p.stop].clone() for p in placement.pieces]
    return placement, client.request("init", header, tensors)


@pytest.mark.timeout(30)
def test_init_first_wins_and_a_mismatched_placement_is_refused(served) -> None:
    server, (w0, w1) = served("sync")
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert w1.request("pull", {"rank": 1, "step": 0}).kind == "wait"  # nothing to serve before worker 0's init
    assert _init(w1, model, optimizer, rank=1)[1].kind == "wait"
    _, reply = _init(w0, model, optimizer)
    assert reply.kind == "ok"
    assert _init(w1, model, optimizer, rank=1)[1].kind == "ok"
    with pytest.raises(RemoteError, match="placement"):
        _init(w1, nn.Linear(3, 3), torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1), rank=1)


@pytest.mark.timeout(30)
def test_ps0_keeps_each_workers_newest_data_position(served) -> None:
    server, (w0, w1) = served("async")
    model = nn.Linear(3, 2)
    _init(w0, model, torch.optim.SGD(model.parameters(), lr=0.1))
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    reply = w0.request("positions", {"rank": 0})
    assert reply.kind == "positions" and reply.header["ranks"] == []
    for data in (b'{"step": 10}', b'{"step": 20}'):
        assert w1.request("position", {"rank": 1}, [as_tensor(data)]).kind == "ok"
    reply = w0.request("positions", {"rank": 0})
    assert reply.header["ranks"] == [1] and [t.numpy().tobytes() for t in reply.torch_tensors()] == [b'{"step": 20}']
    with pytest.raises(RemoteError, match="rank"):
        w1.request("position", {"rank": 5}, [as_tensor(b"{}")])
    with pytest.raises(RemoteError, match="uint8"):
        w1.request("position", {"rank": 1}, [torch.zeros(2)])


@pytest.mark.timeout(30)
def test_sync_averages_in_rank_order_and_applies_once(served) -> None:
    server, (w0, w1) = served("sync")
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    placement, _ = _init(w0, model, optimizer)
    keys = [p.key for p in placement.pieces]
    g = {r: [torch.randn(p.numel) for p in placement.pieces] for r in range(2)}
    assert w1.request("push", {"rank": 1, "step": 0, "read": 0, "keys": keys}, g[1]).kind == "ok"
    assert w0.request("push", {"rank": 0, "step": 0, "read": 0, "keys": keys}, g[0]).kind == "ok"
    w0.request("commit", {"rank": 0, "step": 0, "read": 0})
    assert w0.request("pull", {"rank": 0, "step": 1}).kind == "wait"  # worker 1 has not committed
    w1.request("commit", {"rank": 1, "step": 0, "read": 0})
    reply = w0.request("pull", {"rank": 0, "step": 1})
    expected = ServerOptimizer(OptimizerSpec.from_optimizer(optimizer, model.named_parameters()),
                               {p.key: v for p, v in zip(placement.pieces, [model.weight.reshape(-1),
                                                                            model.bias.reshape(-1)], strict=True)})
    expected.apply({k: mean_of_gradients([g[0][i], g[1][i]]) for i, k in enumerate(keys)})
    params = read_reply(reply, ParamsReply, what="pull")  # the pieces may travel packed into one frame
    assert params.version == 1 and params.keys == keys
    for key, value in zip(params.keys, params.values, strict=True):
        assert torch.equal(value, expected.params[key])
    assert server.staleness == {0: 2}


@pytest.mark.timeout(60)
def test_a_held_pull_is_answered_by_the_commit_that_makes_it_ready_or_told_to_wait_after_its_hold(
        served, monkeypatch) -> None:
    server, (w0, w1) = served("sync")
    model = nn.Linear(3, 2)
    placement, _ = _init(w0, model, torch.optim.SGD(model.parameters(), lr=0.1))
    keys = [p.key for p in placement.pieces]
    started = time.monotonic()
    assert w0.request("pull", {"rank": 0, "step": 1, "hold": 200}).kind == "wait"  # nobody committed yet
    assert time.monotonic() - started >= 0.2
    for rank, worker in enumerate((w0, w1)):
        worker.request("push", {"rank": rank, "step": 0, "read": 0, "keys": keys},
                       [torch.ones(p.numel) for p in placement.pieces])
    w0.request("commit", {"rank": 0, "step": 0, "read": 0})
    monkeypatch.setattr("conveyor.strategies.ps.server.MAX_HOLD_MS", 60_000)  # a slow machine cannot expire it
    held = w0.send("pull", {"rank": 0, "step": 1, "hold": 60_000})
    w1.request("commit", {"rank": 1, "step": 0, "read": 0})  # step 0 is applied: the held pull is answered
    reply = w0.receive(held)
    assert reply.kind == "params" and reply.header["version"] == 1 and reply.header["held"] > 0
    assert server.counters["pull_waits"] == 1 and server.counters["pulls"] == 1


@pytest.mark.timeout(30)
def test_a_pull_from_a_peer_that_has_not_read_a_reply_of_the_pieces_is_told_to_wait(served, monkeypatch) -> None:
    server, (w0, w1) = served("async")
    model = nn.Linear(3, 2)
    placement, _ = _init(w0, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert server.max_unsent_bytes == sum(p.numel for p in placement.pieces) * 4  # one reply of its pieces
    unsent = {"bytes": server.max_unsent_bytes}  # what the transport says the asking peer has not read
    monkeypatch.setattr(server.server, "unsent_bytes", lambda peer=None: unsent["bytes"])
    assert w1.request("pull", {"rank": 1, "step": 0}).kind == "params"  # at the bound: still answered
    unsent["bytes"] += 1
    assert w1.request("pull", {"rank": 1, "step": 0}).kind == "wait"  # over it: asks again once it reads
    held = w1.send("pull", {"rank": 1, "step": 0, "hold": 60_000})
    assert w1.receive(held).kind == "wait" and server.counters["pull_backlogged"] == 2
    unsent["bytes"] = 0
    assert w1.request("pull", {"rank": 1, "step": 0}).kind == "params"


@pytest.mark.timeout(30)
def test_ssp_pull_waits_beyond_the_bound_and_staleness_is_recorded(served) -> None:
    server, (w0, w1) = served("ssp", staleness=1)
    model = nn.Linear(2, 1)
    placement, _ = _init(w0, model, torch.optim.SGD(model.parameters(), lr=0.1))
    keys = [p.key for p in placement.pieces]
    grads = [torch.ones(p.numel) for p in placement.pieces]
    for step in range(2):  # worker 0 runs ahead; worker 1 stays at clock 0
        assert w0.request("pull", {"rank": 0, "step": step}).kind == "params"
        w0.request("push", {"rank": 0, "step": step, "read": 0, "keys": keys}, grads)
        w0.request("commit", {"rank": 0, "step": step, "read": 0})
    assert w0.request("pull", {"rank": 0, "step": 2}).kind == "wait"  # 2 steps ahead of the slowest, K = 1
    w1.request("push", {"rank": 1, "step": 0, "read": 0, "keys": keys}, grads)
    w1.request("commit", {"rank": 1, "step": 0, "read": 0})
    assert w0.request("pull", {"rank": 0, "step": 2}).kind == "params"
    assert server.staleness == {0: 2, 1: 1}  # pushes of (step - read): 0, 1 from worker 0, 0 from worker 1
    assert server.counters["updates"] == 3


@pytest.mark.timeout(30)
def test_a_ps_shard_saved_into_a_checkpoint_restores_a_fresh_server(served, tmp_path: Path) -> None:
    stores = shard_stores(tmp_path, CheckpointManager)
    server, (w0, w1) = served("async", shards=stores)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    placement, _ = _init(w0, model, optimizer)
    keys = [p.key for p in placement.pieces]
    for step in range(3):
        w0.request("push", {"rank": 0, "step": step, "read": 0, "keys": keys},
                   [torch.randn(p.numel) for p in placement.pieces])
        reply = w0.request("commit", {"rank": 0, "step": step, "read": 0, "plan": 10})
    w1.request("commit", {"rank": 1, "step": 0, "read": 0})
    assert reply.header["plan"] == 10 and w0.request("commit", {"rank": 0, "step": 3}).header["total"] == 5

    root = str(tmp_path / "checkpoints")
    parts = w0.request("save", {"rank": 0, "step": 7, "root": root}).header["parts"]
    assert parts == ["ps-0.safetensors", "ps-0.json"]
    CheckpointManager(root).finalize(7, parts)  # what the chief's save does with the parts
    saved, _ = server.opt.state_dict()

    fresh, (f0, _) = served("async", shards=stores)
    _init(f0, model, optimizer)  # the model's initial values, not the trained ones
    assert f0.request("restore", {"rank": 0, "step": 7, "root": root}).kind == "ok"
    restored, _ = fresh.opt.state_dict()
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)

    with pytest.raises(RemoteError, match="outside this task's output folder"):
        w0.request("save", {"rank": 0, "step": 8, "root": str(tmp_path.parent / "elsewhere")})
    other, (o0, _) = served("async", shards=stores)
    wider = nn.Linear(3, 3)
    _init(o0, wider, torch.optim.Adam(wider.parameters()))
    with pytest.raises(RemoteError, match="another model or ps layout"):
        o0.request("restore", {"rank": 0, "step": 7, "root": root})


@pytest.mark.timeout(30)
def test_a_shard_that_is_json_but_not_an_object_is_refused_naming_the_file_and_step(served, tmp_path: Path) -> None:
    server, (w0, _) = served("async", shards=shard_stores(tmp_path, CheckpointManager))
    model = nn.Linear(3, 2)
    _init(w0, model, torch.optim.SGD(model.parameters(), lr=0.1))
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(root)
    for name, data in (("ps-0.json", b"[1, 2]"), ("ps-0.safetensors", b"{}")):
        manager.save_part(9, name, data)
    manager.finalize(9, ["ps-0.json", "ps-0.safetensors"])
    with pytest.raises(RemoteError, match=r"ps-0.json of checkpoint step 9 is not ps:0's shard"):
        w0.request("restore", {"rank": 0, "step": 9, "root": str(root)})


def test_the_chief_logs_staleness_as_percentiles_and_keeps_the_histogram_for_the_json(tmp_path: Path, capsys) -> None:
    strategy = PSStrategy("async")
    strategy._job = type("FakeJob", (), {"output_dir": tmp_path})()
    histogram = {str(k): 1 + (k % 7) for k in range(376)}  # a long async run's staleness table
    stats = {"step": 900, "push_seconds": 1.0, "pull_seconds": 2.0, "wait_seconds": 0.5, "staleness": histogram,
             "max_staleness": 375, "bytes_out_per_server": [2**20], "bytes_in_per_server": [2**20],
             "servers": [{"dropped": 0}]}
    strategy._print_stats(stats)
    line = capsys.readouterr().out.strip()
    total = sum(histogram.values())
    assert len(line) < 400 and "'374'" not in line, line
    assert f"staleness n={total} p50=" in line and " p90=" in line and " p99=" in line and "max=375" in line, line
    assert json.loads((tmp_path / "ps-stats.json").read_text())["staleness"] == histogram


# -- tests across processes -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory: pytest.TempPathFactory):
    """``run(kind)``: one ps-sync launch of scenario ``kind`` per module, as (worker results, exit codes, folder);
    the sgd launch serves both the comparison with one process and the undisturbed twin of the attacked run."""
    runs: dict[str, tuple[list[dict], list[int], Path]] = {}

    def run(kind: str) -> tuple[list[dict], list[int], Path]:
        if kind not in runs:
            out = tmp_path_factory.mktemp(f"ps-sync-{kind}")
            runs[kind] = (*launch(kind, "ps-sync", out), out)
        return runs[kind]

    return run


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_DEADLINE + 60)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_ps_sync_matches_one_process_on_the_combined_batch(sync_runs, kind: str) -> None:
    results, codes, out = sync_runs(kind)
    assert codes == [0] * (WORLD + NUM_PS), logs(out)  # the ps tasks exit cleanly when the workers finish
    expected = torch.tensor(reference(kind))
    for r in results:
        assert torch.allclose(torch.tensor(r["params"]), expected, atol=1e-5, rtol=0), r["params"][:5]
        assert r["stats"]["max_staleness"] == 0 and r["stats"]["step"] == STEPS
        assert r["state_servers"] == NUM_PS
        assert all(s["version"] == STEPS for s in r["stats"]["servers"])
        assert r["comm"] > 0
    assert results[0]["params"] == results[1]["params"]
    assert "parameter placement" in (out / "worker0.log").read_text()


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_DEADLINE + 60)
def test_ps_async_trains(tmp_path: Path) -> None:
    results, codes = launch("async", "ps-async", tmp_path)
    assert codes == [0] * (WORLD + NUM_PS), logs(tmp_path)
    for r in results:
        assert r["last"] < 0.9 * r["first"], (r["first"], r["last"], r["losses"])
    assert all(s["counters"]["updates"] > 0 for s in results[0]["stats"]["servers"])


class _Counter:
    """ps:0's shared step count as each worker sees it: the count its own last commit was answered with."""

    def __init__(self) -> None:
        self.total, self.plan = 0, None

    def board(self, seen: dict[int, int], rank: int):
        counter = self

        class Board:
            def global_progress(self):
                return seen.get(rank, 0), counter.plan

            def announce_total(self, total):
                counter.plan = total

        return Board()


@pytest.mark.parametrize("world", [2, 3, 5])
def test_ps_async_workers_running_apart_stop_on_exactly_the_planned_step_count(world):
    """Workers in async steps, committing in a random order: the shared count ends on max_steps x workers,
    never over it (progress read `step 221/220`), and never under it."""
    import random
    from types import SimpleNamespace

    from conveyor.strategies.coordination import IndependentCoordinator

    for seed in range(200):
        rng, counter, seen = random.Random(seed), _Counter(), {}
        coords = [IndependentCoordinator(SimpleNamespace(world_size=world, rank=r, is_chief=r == 0),
                                         counter.board(seen, r)) for r in range(world)]
        for coord in coords:
            coord.start(max_steps=7, total_epochs=None)
        running, in_step = set(range(world)), set()
        while running:
            rank = rng.choice(sorted(running))
            if rank in in_step:  # its commit reaches ps:0, which answers with the count
                counter.total += 1
                seen[rank] = counter.total
                in_step.discard(rank)
            elif coords[rank].finished(0, None):
                running.discard(rank)
            else:
                in_step.add(rank)  # a forward and backward, while the others go on
        assert counter.total == 7 * world, (seed, counter.total)


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_DEADLINE + 60)
def test_ps_ssp_bounds_staleness(tmp_path: Path) -> None:
    results, codes = launch("ssp", "ps-ssp:2", tmp_path)
    assert codes == [0] * (WORLD + NUM_PS), logs(tmp_path)
    stats = results[0]["stats"]  # gathered from the servers: every push of both workers
    seen = {int(k) for k in stats["staleness"]}
    assert max(seen) <= 2, stats["staleness"]
    assert max(seen) > 0, stats["staleness"]
    assert results[0]["stats"]["wait_seconds"] > 0  # the fast worker waited for the slow one


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_DEADLINE + 60)
def test_trainer_lets_async_workers_run_apart_and_stops_on_the_shared_step_count(tmp_path: Path) -> None:
    results, codes = launch("apart", "ps-async", tmp_path)
    assert codes == [0] * (WORLD + NUM_PS), logs(tmp_path)
    # The fast worker's last pull came long before the slow one's last commit; fit() ends on both with a pull after
    # every commit (Step.finish), so both hold the servers' final state, the one the last checkpoint's shards hold.
    assert results[0]["params"] == results[1]["params"]
    fast, slow = results[0]["steps"], results[1]["steps"]
    planned = 2 * 20 * WORLD  # epochs x steps per epoch x workers
    assert fast > 1.5 * slow, (fast, slow)  # worker 1 sleeps 50 ms a step; worker 0 does not wait for it
    assert fast + slow == planned, (fast, slow)  # together, exactly the job's steps: none over
    summary = results[0]["summary"]
    assert summary["samples"] == (fast + slow) * BATCH
    evals = [json.loads(line) for line in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert [e["step"] for e in evals[:-1]] == list(range(7, fast + 1, 7))  # the chief's own, on its shard
    trains = [json.loads(line) for line in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()
              if '"train"' in line]
    shared = [r["global_step"] for r in trains]  # the progress display shows the job's step, not the chief's
    assert shared == sorted(shared) and all(r["global_step"] >= r["step"] for r in trains)
    assert planned - WORLD < shared[-1] <= planned
    assert evals[-1]["step"] == fast and evals[-1]["eval_loss"] == summary["eval_loss"]  # the last: both shards
    assert evals[-1]["global_step"] == planned  # what the progress line shows for it: the job's step
    checkpoints = tmp_path / "output" / "checkpoints"
    manifest = json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "COMPLETE").read_text())
    assert {"ps-0.safetensors", "ps-1.json", "data/worker-0.json", "data/worker-1.json"} <= set(manifest["parts"])
    earlier = [json.loads((step / "COMPLETE").read_text())["parts"] for step in checkpoints.glob("step-*")
               if step.name != (checkpoints / "latest").read_text().strip()]
    assert any("data/worker-1.json" in parts for parts in earlier)  # left with ps:0 by the slow worker as it went


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * LAUNCH_DEADLINE + 60)  # two launches, if the undisturbed one has not run yet
def test_garbage_and_forged_messages_change_nothing(tmp_path: Path, sync_runs) -> None:
    results, codes = launch("garbage", "ps-sync", tmp_path)
    assert codes == [0] * (WORLD + NUM_PS), logs(tmp_path)
    expected = torch.tensor(reference("sgd"))
    params = torch.tensor(results[0]["params"])
    undisturbed, _, _ = sync_runs("sgd")  # the same job without the attack
    assert results[0]["params"] == undisturbed[0]["params"]
    assert torch.allclose(params, expected, atol=1e-5, rtol=0)
    servers = results[0]["stats"]["servers"]
    assert all(s["dropped"] > 0 for s in servers), servers


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_DEADLINE + 60)
def test_conveyor_run_starts_ps_tasks_that_exit_cleanly(tmp_path: Path) -> None:
    """`conveyor run -n 2 --ps 2 --strategy ps-sync` on this same script: the launcher's path end to end."""
    from taskrun import launcher_var

    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN and not launcher_var(k)}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "results"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "conveyor.cli.main", "run", "-n", "2", "--ps", "2", "--strategy",
                           "ps-sync", "--output-dir", str(tmp_path / "output"), __file__, "sgd", str(out)],
                          env=env, capture_output=True, text=True, timeout=LAUNCH_DEADLINE)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "still running" not in text, text  # the ps tasks exited by themselves, not stopped by the launcher
    assert "every worker is done; exiting" in text
    for i in range(NUM_PS):  # each event of a ps task is said once, not by the task and again by its server
        assert text.count(f"ps:{i}: every worker is done") == 1, text
        assert len([line for line in text.splitlines() if f"ps:{i}: serving" in line]) == 1, text
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert torch.allclose(torch.tensor(results[0]["params"]), torch.tensor(reference("sgd")), atol=1e-5, rtol=0)
    assert (tmp_path / "output" / "ps-stats.json").exists()


if __name__ == "__main__":
    task_main(sys.argv[1], Path(sys.argv[2]))
