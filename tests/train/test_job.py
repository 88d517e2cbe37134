"""conveyor.init() and Job in one process: identity, strategy choice, errors, the world-of-one collectives,
rendezvous failures, and collective_guard's naming of a dead peer (fed gloo's real messages, no processes)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import conveyor
from conveyor.cluster import ClusterSpec, local_cluster
from conveyor.cluster.strategy_name import StrategyName
from conveyor.comm.process_group import (
    AddressInUseError,
    GroupInfo,
    PeerError,
    RendezvousError,
    collective_guard,
    peer_error,
)
from conveyor.launch.ports import free_ports
from conveyor.strategies import NAMES, AllReduceStrategy, LocalStrategy, get_strategy
from conveyor.train import job as job_mod
from conveyor.train.job import Job, init, threads_per_worker

# What gloo raised in torch 2.13 when the peer process had died / stayed silent (see process_group.py).
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[{ip}]:21376. This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"CONVEYOR_OUTPUT_DIR": str(tmp_path / "out"), "CONVEYOR_DATA_DIR": str(tmp_path / "data")}


def free_port() -> int:
    return free_ports(1)[0]  # from this xdist worker's range, if any (tests/conftest.py)


def torchrun_env(env: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    return env | {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


# -- identity and configuration ---------------------------------------------------------------------------------------


def test_init_without_a_launcher_is_one_local_worker(env: dict[str, str], tmp_path: Path) -> None:
    job = init(environ=env)
    assert isinstance(job, Job) and conveyor.init is init
    assert (job.rank, job.world_size, job.local_rank, job.local_world_size) == (0, 1, 0, 1)
    assert job.is_chief and job.task_type == "worker" and job.task_index == 0 and job.cluster is None
    assert isinstance(job.strategy, LocalStrategy) and str(job.strategy) == job.strategy.name == "local"
    assert job.device == torch.device("cpu")
    assert job.data_dir == tmp_path / "data" and job.output_dir == tmp_path / "out" and job.output_dir.is_dir()
    assert (job.restart_count, job.resume, job.timeout) == (0, True, 300.0)
    assert not dist.is_initialized()
    job.shutdown()


def test_init_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("RANK", "WORLD_SIZE", "TF_CONFIG", "SLURM_PROCID", "CONVEYOR_TASK_TYPE", "CONVEYOR_DATA_DIR",
                 "CONVEYOR_OUTPUT_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONVEYOR_STRATEGY", "allreduce")
    monkeypatch.setenv("CONVEYOR_TIMEOUT", "12.5")
    monkeypatch.setenv("CONVEYOR_RESTART_COUNT", "2")
    monkeypatch.setenv("CONVEYOR_RESUME", "0")
    with conveyor.init() as job:
        assert isinstance(job.strategy, AllReduceStrategy)
        assert (job.timeout, job.restart_count, job.resume) == (12.5, 2, False)
        assert job.data_dir == Path("data") and job.output_dir == Path("output")
        assert (tmp_path / "output").is_dir(), "the output folder is created, relative to the working directory"
        model = nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped, same = job.prepare(model, optimizer)
        assert wrapped is model and same is optimizer, "one process has nothing to all-reduce: nothing is wrapped"
        assert job.strategy.step.comm_seconds() == 0.0


def test_job_settings_hold_what_the_launcher_gave_parsed(env: dict[str, str]) -> None:
    pipeline = {"CONVEYOR_PIPELINE_STAGES": "2", "CONVEYOR_PIPELINE_MICROBATCHES": "8",
                "CONVEYOR_PIPELINE_SCHEDULE": " gpipe", "CONVEYOR_PIPELINE_SPLIT": "blocks.2, head"}
    with init("local", share_gpus=True, environ=env | pipeline | {"CONVEYOR_TIMEOUT": "9"}) as job:
        settings = job.settings
        assert (settings.stages, settings.microbatches, settings.schedule, settings.split) == (
            2, 8, "gpipe", ("blocks.2", "head"))
        assert settings.strategy == StrategyName("local") and (settings.timeout, settings.share_gpus) == (9.0, True)
        assert (settings.timeout, settings.restart_count, settings.resume) == (job.timeout, 0, True)
    with pytest.raises(ValueError, match="CONVEYOR_PIPELINE_MICROBATCHES='x' is not a whole number"):
        init("local", environ=env | {"CONVEYOR_PIPELINE_MICROBATCHES": "x"})


def test_argument_beats_environment(env: dict[str, str]) -> None:
    with init("local", timeout=7, environ=env | {"CONVEYOR_STRATEGY": "allreduce", "CONVEYOR_TIMEOUT": "9"}) as job:
        assert job.strategy.name == "local" and job.timeout == 7.0


@pytest.mark.parametrize(("name", "message"), [
    ("sgd", "unknown strategy 'sgd'"),
    ("ps-async", "needs parameter servers, but this job has none"),
    ("ps-sync", "needs parameter servers, but this job has none"),
    ("ps-ssp:4", "needs parameter servers, but this job has none"),
    ("ps-ssp:0", "needs parameter servers, but this job has none"),
    ("pipeline", "needs the number of stages: conveyor run --stages S"),
    ("ps-ssp", "staleness bound K"),
    ("ps-ssp:x", "staleness bound K"),
])
def test_bad_or_unimplemented_strategy_is_refused(env: dict[str, str], name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        init(name, environ=env)
    with pytest.raises(ValueError, match=message):
        init(environ=env | {"CONVEYOR_STRATEGY": name})
    assert "allreduce" in NAMES and "ps-ssp:K" in NAMES


def test_get_strategy_returns_fresh_unbound_strategies() -> None:
    a, b = get_strategy("allreduce"), get_strategy(" AllReduce ")
    assert isinstance(a, AllReduceStrategy) and a is not b
    with pytest.raises(RuntimeError, match="not set up"):
        a.prepare(nn.Linear(1, 1), None)


def test_local_strategy_refuses_a_multi_worker_job(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="each train their own model"):
        init("local", environ=torchrun_env(env, 0, 2, free_port()))
    assert not dist.is_initialized(), "refused before any rendezvous"


def test_parameter_server_task_refuses_a_non_ps_strategy(env: dict[str, str]) -> None:
    tf_config = ClusterSpec(worker=("127.0.0.1:2001",), ps=("127.0.0.1:2002",)).to_tf_config("ps", 0)
    with pytest.raises(ValueError, match="parameter server ps:0, but the strategy is 'allreduce'"):
        init("allreduce", environ=env | {"TF_CONFIG": tf_config})


@pytest.mark.parametrize("value", ["abc", "0", "-3", "inf"])
def test_bad_timeout_is_refused(env: dict[str, str], value: str) -> None:
    with pytest.raises(ValueError, match="CONVEYOR_TIMEOUT"):
        init(environ=env | {"CONVEYOR_TIMEOUT": value})


def test_bad_timeout_argument_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"init\(timeout=...\)"):
        init(timeout=0, environ=env)


def test_bad_restart_count_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="CONVEYOR_RESTART_COUNT"):
        init(environ=env | {"CONVEYOR_RESTART_COUNT": "two"})


@pytest.mark.parametrize(("workers", "cores", "threads"), [(1, 8, 8), (2, 2, 1), (3, 2, 1), (4, 16, 4), (2, 1, 1)])
def test_threads_per_worker_shares_the_cores(workers: int, cores: int, threads: int) -> None:
    assert threads_per_worker(workers, cores) == threads


def test_several_local_workers_limit_their_threads_unless_told_otherwise() -> None:
    before = torch.get_num_threads()
    try:
        job_mod._limit_threads(2, {"OMP_NUM_THREADS": "3"})
        assert torch.get_num_threads() == before, "an explicit OMP_NUM_THREADS is respected"
        job_mod._limit_threads(2, {})
        cores = len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == max(1, cores // 2)
    finally:
        torch.set_num_threads(before)


def test_the_launchers_torchrun_style_omp_default_is_replaced_by_a_share_of_the_cores() -> None:
    from conveyor.launch.plan import OMP_DEFAULT_VAR
    assert job_mod.OMP_DEFAULT_VAR == OMP_DEFAULT_VAR  # the launcher and init() name the marker alike
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(1)
        job_mod._limit_threads(1, {"OMP_NUM_THREADS": "1", OMP_DEFAULT_VAR: "1"})  # one worker beside a ps
        assert torch.get_num_threads() == cores
        job_mod._limit_threads(2, {"OMP_NUM_THREADS": "1", OMP_DEFAULT_VAR: "1"})
        assert torch.get_num_threads() == max(1, cores // 2)
    finally:
        torch.set_num_threads(before)


def test_prepare_refuses_an_optimizer_of_another_model(env: dict[str, str]) -> None:
    with init(environ=env) as job:
        with pytest.raises(ValueError, match="not parameters of the model"):
            job.prepare(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


# -- collectives in a world of one -----------------------------------------------------------------------------------


def test_collectives_work_without_a_process_group(env: dict[str, str]) -> None:
    with init(environ=env) as job:
        assert job.all_gather_bytes(b"abc") == [b"abc"]
        assert job.all_gather_bytes(b"") == [b""]
        assert job.all_gather_bytes(bytearray(b"\x00\xff")) == [b"\x00\xff"]
        assert job.broadcast_bytes(b"hello") == b"hello"
        for op in ("sum", "mean", "max", "min", "product"):
            t = torch.tensor([1.5, -2.0])
            assert job.all_reduce(t, op) is t and t.tolist() == [1.5, -2.0]
        job.barrier()
        assert not dist.is_initialized()


def test_collective_arguments_are_checked(env: dict[str, str]) -> None:
    with init(environ=env) as job:
        with pytest.raises(TypeError, match="must be bytes"):
            job.all_gather_bytes("text")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="must pass bytes, not None"):
            job.broadcast_bytes(None)
        with pytest.raises(ValueError, match="expected a rank 0..0"):
            job.broadcast_bytes(b"x", src=1)
        with pytest.raises(ValueError, match="'sum', 'mean'"):
            job.all_reduce(torch.ones(1), "avg-ish")


def test_shutdown_is_idempotent_and_final(env: dict[str, str]) -> None:
    with init(environ=env) as job:
        pass
    job.shutdown()
    with pytest.raises(RuntimeError, match="after job.shutdown"):
        job.all_gather_bytes(b"x")


def test_leaving_with_an_exception_does_not_wait_for_the_peers(env: dict[str, str], monkeypatch) -> None:
    calls = []
    with init(environ=env) as job:
        pass
    monkeypatch.setattr(type(job), "shutdown", lambda self, wait_for_peers=True: calls.append(wait_for_peers))
    with job:
        pass
    with pytest.raises(ValueError), job:
        raise ValueError("a failing rank must exit at once, not wait in a barrier its peers never reach")
    assert calls == [True, False]


# -- rendezvous failures (one real process, the others never come) ---------------------------------------------------


@pytest.mark.timeout(30)
def test_rank0_alone_gets_a_rendezvous_error_naming_the_address(env: dict[str, str]) -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        init(timeout=1, environ=torchrun_env(env, 0, 2, port))
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "1 of 2 ranks arrived" in message
    assert "every task was started" in message and f"port {port} is free" in message
    assert time.monotonic() - start < 10
    assert not dist.is_initialized()


@pytest.mark.timeout(30)
def test_worker_without_rank0_gets_a_rendezvous_error(env: dict[str, str]) -> None:
    port = free_port()
    with pytest.raises(RendezvousError, match=f"could not reach the rendezvous store at 127.0.0.1:{port}"):
        init(timeout=1, environ=torchrun_env(env, 1, 2, port))
    assert not dist.is_initialized()


@pytest.mark.timeout(30)
def test_port_in_use_on_rank0_is_named(env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AddressInUseError, match=f"port {port}.*already in use.*MASTER_PORT"):
            init(timeout=5, environ=torchrun_env(env, 0, 2, port))
    assert not dist.is_initialized()


# -- collective_guard: gloo's messages → PeerError naming the peer ----------------------------------------------------


def spec_of(hosts: list[str]) -> ClusterSpec:
    return ClusterSpec(worker=tuple(f"{h}:{2000 + i}" for i, h in enumerate(hosts)))


def test_dead_peer_in_a_pair_is_named_with_its_task_and_address() -> None:
    group = GroupInfo(rank=0, world_size=2, spec=local_cluster(2, 0, [23001, 23002]), timeout=5.0)
    with pytest.raises(PeerError) as info, collective_guard(group, "all_gather_bytes"):
        raise RuntimeError(GLOO_CLOSED.format(ip="127.0.0.1"))
    e = info.value
    assert (e.peer_rank, str(e.peer_task), e.peer_address, e.timed_out) == (1, "worker:1", "127.0.0.1:23002", False)
    assert str(e).startswith("all_gather_bytes failed on rank 0: rank 1 (worker:1 at 127.0.0.1:23002) closed")
    assert "logs/worker-1.log" in str(e) and "Connection closed by peer" in str(e)
    assert isinstance(e.__cause__, RuntimeError)


def test_silent_peer_is_reported_with_the_timeout_and_the_fix() -> None:
    group = GroupInfo(rank=1, world_size=2, spec=ClusterSpec(chief=("h0:1",), worker=("h1:1",)), timeout=5.0)
    e = peer_error(RuntimeError(GLOO_TIMEOUT), group, "barrier")
    assert e.timed_out and e.peer_rank == 0 and str(e.peer_task) == "chief:0"
    assert "did not take part within the 5 s timeout" in str(e) and "CONVEYOR_TIMEOUT" in str(e)


def test_peer_is_found_by_ip_when_hosts_differ_and_listed_when_they_do_not() -> None:
    group = GroupInfo(rank=0, world_size=3, spec=spec_of(["10.0.0.1", "10.0.0.2", "10.0.0.3"]))
    assert peer_error(RuntimeError(GLOO_CLOSED.format(ip="10.0.0.3")), group).peer_rank == 2
    same_host = GroupInfo(rank=0, world_size=3, spec=spec_of(["10.0.0.1"] * 3))
    e = peer_error(RuntimeError(GLOO_CLOSED.format(ip="10.0.0.1")), same_host)
    assert e.peer_rank is None and "one of rank 1 (worker:1 at 10.0.0.1:2001), rank 2 (worker:2" in str(e)
    no_spec = peer_error(RuntimeError(GLOO_CLOSED.format(ip="10.0.0.1")), GroupInfo(rank=0, world_size=3))
    assert no_spec.peer_rank is None and "a peer rank closed its connection" in str(no_spec)


def test_other_errors_pass_through_the_guard_untouched() -> None:
    original = RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x4 and 3x16)")
    with pytest.raises(RuntimeError) as info, collective_guard(GroupInfo(rank=0, world_size=2)):
        raise original
    assert info.value is original
    with pytest.raises(KeyError), collective_guard(GroupInfo(rank=0, world_size=2)):
        raise KeyError("x")


def test_a_peer_error_re_wrapped_by_autograd_comes_back_as_itself() -> None:
    group = GroupInfo(rank=0, world_size=2, spec=local_cluster(2, 0, [23001, 23002]))
    made = peer_error(RuntimeError(GLOO_CLOSED.format(ip="127.0.0.1")), group, "gradient all-reduce")
    wrapped = RuntimeError(f"Got the following error when running the callback: PeerError: {made}\n\nAt:\n  hook")
    with pytest.raises(PeerError) as info, collective_guard(group, "training step"):
        raise wrapped
    assert info.value is made and info.value.peer_rank == 1
    unknown = RuntimeError("Got the following error when running the callback: PeerError: gone\n\nAt:\n  x")
    assert str(peer_error(unknown, group)) == "gone"
