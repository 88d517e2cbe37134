"""The worker's client against in-process ps tasks: the requests the strategy makes, as methods; and the
ps task's entry (``serve_ps_task``), which returns the exit status ``conveyor.init()`` exits with."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from conveyor.cluster import discover, local_cluster, task_environment
from conveyor.comm.transport import Client, RemoteError
from conveyor.launch.ports import free_ports
from conveyor.strategies.ps.client import PSClient
from conveyor.strategies.ps.server import ParameterServer
from conveyor.strategies.ps.strategy import staleness_summary
from conveyor.strategies.ps.task import serve_ps_task, shard_stores
from conveyor.train.checkpoint import CheckpointManager

SECRET = b"ps-client-test-secret"


@pytest.fixture
def two_servers(tmp_path: Path):
    ports = free_ports(2)
    stores = shard_stores(tmp_path, CheckpointManager)
    servers = [ParameterServer(f"127.0.0.1:{p}", SECRET, index=i, num_workers=1, mode="async", shards=stores).start()
               for i, p in enumerate(ports)]
    client = PSClient([f"127.0.0.1:{p}" for p in ports], SECRET, rank=0, num_workers=1, sender="worker:0",
                      timeout=10.0, chunk_bytes=16)
    yield servers, client
    client.close()
    for server in servers:
        server.close()


def _train(client: PSClient, steps: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    client.connect(model, optimizer)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        client.finish_step()
    return model


@pytest.mark.timeout(60)
def test_the_client_has_a_method_for_every_request_the_strategy_makes(two_servers, tmp_path: Path) -> None:
    servers, client = two_servers
    model = _train(client, 3)
    assert client.num_servers == 2 and client.global_steps == 3
    stats = client.stats()
    assert [s.name for s in stats] == ["ps:0", "ps:1"] and all(s.clock == [3] and s.pieces > 0 for s in stats)

    root = tmp_path / "checkpoints"
    parts = client.save_shards(4, root)
    assert parts == ["ps-0.safetensors", "ps-0.json", "ps-1.safetensors", "ps-1.json"]
    CheckpointManager(root).finalize(4, parts)
    saved = [s.named for s in client.state()]
    trained = [p.detach().clone() for p in model.parameters()]

    moved = _steps(client, model, 2)
    assert not all(torch.equal(a, b) for a, b in zip(trained, moved, strict=True))
    client.restore_shards(4, root)
    client.pull()
    assert all(torch.equal(a, p) for a, p in zip(trained, model.parameters(), strict=True))

    states = client.state()
    assert all(s.named.keys() == before.keys() and all(torch.equal(s.named[k], before[k]) for k in before)
               for s, before in zip(states, saved, strict=True))
    _steps(client, model, 1)
    client.load_state([(s.meta, s.named) for s in states])
    client.pull()
    assert all(torch.equal(a, p) for a, p in zip(trained, model.parameters(), strict=True))

    assert client.positions() == [None]
    client.publish_position(b'{"step": 4}')
    assert client.positions() == [b'{"step": 4}']
    with pytest.raises(RemoteError, match="outside this task's output folder"):
        client.save_shards(5, tmp_path.parent / "elsewhere")


def _steps(client: PSClient, model: nn.Module, steps: int) -> list[torch.Tensor]:
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        client.finish_step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(60)
def test_ssp_a_worker_ahead_evaluates_after_the_other_stopped_at_the_plan() -> None:
    # The ps-ssp final-evaluation stall, step by step (K = 1, the workers stop at 5 steps together): worker 0
    # reaches the plan with its step 1 and stops; worker 1, whose last commit reply still said 4, trains its
    # step 3 and prefetches the pull for step 4, two steps ahead of worker 0, which never commits again. Its
    # evaluation's forward collects that pull: it must get parameters, not 'wait' until the timeout.
    port = free_ports(1)[0]
    server = ParameterServer(f"127.0.0.1:{port}", SECRET, index=0, num_workers=2, mode="ssp", staleness=1).start()
    clients = [PSClient([f"127.0.0.1:{port}"], SECRET, rank=r, num_workers=2, sender=f"worker:{r}", timeout=6.0)
               for r in range(2)]
    try:
        models = []
        for client in clients:
            torch.manual_seed(0)
            model = nn.Linear(4, 3)
            client.connect(model, torch.optim.SGD(model.parameters(), lr=0.1))
            client.announce = 5
            models.append(model)

        def step(rank: int) -> None:  # what PSStrategy does with ps-ssp: the forward collects the prefetched pull
            clients[rank].finish_pull()
            models[rank].zero_grad()
            models[rank](torch.randn(2, 4)).sum().backward()
            clients[rank].finish_step(prefetch=True)

        for rank in (1, 0, 1, 1):
            step(rank)
        assert clients[1].global_steps == 4 and server.clock == [1, 3]
        step(0)
        assert clients[0].global_steps == 5  # worker 0 sees the plan reached: it stops training
        step(1)  # worker 1 saw 4 at its last commit: one more step
        assert clients[1].global_steps == 6 and server.clock == [2, 4]
        started = time.monotonic()
        with torch.no_grad():
            for client, model in zip(clients, models, strict=True):  # both evaluate
                client.finish_pull()
                model(torch.randn(2, 4))
        assert time.monotonic() - started < 3.0  # held until the 6 s timeout before the fix
    finally:
        for client in clients:
            client.close()
        server.close()


def test_staleness_summary_percentiles() -> None:
    assert staleness_summary({}) == "n=0"
    assert staleness_summary({"0": 89, "3": 10, "40": 1}) == "n=100 p50=0 p90=3 p99=3 max=40"
    assert staleness_summary({"2": 1}) == "n=1 p50=2 p90=2 p99=2 max=2"


# -- the ps task's entry ----------------------------------------------------------------------------------------------


def _ps_found(tmp_path: Path, strategy: str = "ps-sync"):
    ports = free_ports(3)
    spec = local_cluster(num_workers=1, num_ps=1, ports=ports[:2])
    task = next(t for t in spec.tasks if t.type == "ps")
    env = task_environment(spec, task, secret=SECRET, data_dir=tmp_path / "data", output_dir=tmp_path / "output",
                           strategy=strategy, master_addr="127.0.0.1", master_port=ports[2])
    return discover(env)


@pytest.mark.timeout(60)
def test_a_ps_task_returns_0_when_its_workers_are_done(tmp_path: Path) -> None:
    found = _ps_found(tmp_path)
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(serve_ps_task(found, None, 30.0,
                                                                         checkpoints=CheckpointManager)))
    thread.start()
    with Client(found.spec.task_address("ps", 0), SECRET, name="ps:0", timeout=20.0, sender="worker:0") as worker:
        assert worker.request("done", {"rank": 0}).kind == "ok"
    thread.join(30.0)
    assert status == [0]


@pytest.mark.timeout(60)
def test_a_ps_task_whose_workers_never_come_returns_1_and_says_why(tmp_path: Path, capsys) -> None:
    assert serve_ps_task(_ps_found(tmp_path), None, 0.5, checkpoints=CheckpointManager) == 1
    err = capsys.readouterr().err
    assert "ps:0" in err and "no worker contacted it within 1 s" in err and "CONVEYOR_TIMEOUT" in err, err


def test_a_ps_task_refuses_a_job_that_is_not_a_ps_job(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="parameter server ps:0, but the strategy is 'allreduce'"):
        serve_ps_task(_ps_found(tmp_path), "allreduce", 5.0, checkpoints=CheckpointManager)
