"""The allreduce strategy and the job's collectives across 2 real processes (gloo on 127.0.0.1).

Each launch starts this file as a script twice (``python test_allreduce.py SCENARIO OUT_DIR``) with the
environment conveyor's launcher would give worker 0 and worker 1 (``task_environment``); the workers
write what they saw to JSON and the tests compare. One launch ("train") serves the checks on a healthy
job; "dead" and "silent" each stop rank 1 (os._exit / a long sleep) before a collective.

    pytest tests/strategies/test_allreduce.py -m multiprocess --durations=5
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import conveyor
from conveyor.comm.process_group import PeerError, collective_guard

pytestmark = pytest.mark.multiprocess

WORLD = 2
BATCH = 8  # per worker; the single-process reference uses WORLD * BATCH
STEPS = 10
LR = 0.1
DEAD_TIMEOUT = 5.0  # CONVEYOR_TIMEOUT in the failure launches: the bound a failing collective must respect
SILENT_TIMEOUT = 3.0



# -- shared by the workers and the reference ----------------------------------------------------------------------


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS * WORLD * BATCH, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(len(x), 1, generator=g)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int, batch: int) -> None:
    """STEPS steps of SGD; global batch k is rows [k*W*B, (k+1)*W*B), of which rank r takes its r-th B rows."""
    x, y = make_data()
    for k in range(STEPS):
        lo = k * world * batch + rank * batch
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[lo:lo + batch]), y[lo:lo + batch]).backward()
        optimizer.step()


def flat(model: nn.Module) -> torch.Tensor:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return torch.cat([t.detach().flatten().float() for t in (*inner.parameters(), *inner.buffers())])


# -- launching ------------------------------------------------------------------------------------------------------


def launch(scenario: str, out: Path, timeout: float, deadline: float = 60.0,
           only_rank0: bool = False) -> list[dict | None]:
    """Run SCENARIO on WORLD worker processes; return each rank's JSON (None if it wrote none).

    ``only_rank0``: stop waiting once rank 0 has finished and kill the others (a failure scenario's peer)."""
    out.mkdir(parents=True, exist_ok=True)
    from taskrun import local_job_envs, wait_all  # here: this file also runs as the workers' script, outside pytest

    procs = []
    for rank, env in enumerate(local_job_envs(out, WORLD, "allreduce")):
        env["CONVEYOR_TIMEOUT"] = str(timeout)
        log = open(out / f"rank{rank}.log", "wb")  # closed below, after the process ends
        procs.append((subprocess.Popen([sys.executable, __file__, scenario, str(out)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    wait_all(procs[:1] if only_rank0 else procs, deadline, f"{scenario}: workers", lambda: logs(out))
    for proc, log in procs:  # with only_rank0 the others were not waited for: stop them too
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    results = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def logs(out: Path) -> str:
    return "\n".join(f"--- rank {r} ---\n{(out / f'rank{r}.log').read_text(errors='replace')[-4000:]}"
                     for r in range(WORLD) if (out / f"rank{r}.log").exists())


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("allreduce-train")
    results = launch("train", out, timeout=30.0)
    assert all(r is not None and r.get("ok") for r in results), logs(out)
    return results, out


# -- tests on a healthy job -----------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_parameters_identical_after_prepare_even_if_initialised_differently(healthy) -> None:
    results, out = healthy
    for r in results:
        assert r["differed_before_prepare"], "the workers' models should start different, or the test proves nothing"
        assert r["identical_after_prepare"], logs(out)
        assert r["equal_to_rank0_init"], "DDP broadcasts rank 0's parameters and buffers"


@pytest.mark.timeout(90)
def test_two_workers_match_one_process_with_double_batch(healthy) -> None:
    results, _ = healthy
    model = make_mlp(seed=0)
    train(model, torch.optim.SGD(model.parameters(), lr=LR), rank=0, world=1, batch=WORLD * BATCH)
    reference = flat(model)
    assert not torch.allclose(reference, flat(make_mlp(seed=0))), "training should have moved the parameters"
    for r in results:
        trained = torch.tensor(r["trained"])
        assert torch.allclose(trained, reference, rtol=0, atol=1e-5), (trained - reference).abs().max()


@pytest.mark.timeout(90)
def test_byte_and_tensor_collectives_across_ranks(healthy) -> None:
    results, _ = healthy
    expected_gather = [payload(r).hex() for r in range(WORLD)]
    for r in results:
        assert r["all_gather"] == expected_gather
        assert r["all_gather_empty"] == ["", ""]
        assert r["broadcast_from_0"] == b"rank zero says hi".hex()
        assert r["broadcast_from_1"] == bytes(range(256)).hex()
        assert r["broadcast_empty"] == ""
        assert r["all_reduce"] == {"sum": [3.0, 30.0], "mean": [1.5, 15.0], "max": [2.0, 20.0], "min": [1.0, 10.0]}
        assert r["all_reduce_int_mean"] == [2]


@pytest.mark.timeout(90)
def test_comm_seconds_counts_gradient_communication(healthy) -> None:
    results, _ = healthy
    for r in results:
        assert r["comm_before"] == 0.0
        assert 0.0 < r["comm_after"] < r["train_seconds"], "each step's communication lies within the run"
        assert len(r["comm_steps"]) == 3 and all(s > 0 for s in r["comm_steps"]), r["comm_steps"]
        assert len(set(r["comm_reads_agree"])) == 1, r["comm_reads_agree"]
        assert not r["comm_hook"], f"a comm hook on the buckets: {r['comm_hook']}"
        assert r["strategy"] == "allreduce"
        assert r["threads"] == max(1, r["cores"] // WORLD)


# -- tests with a failing peer --------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_dead_peer_raises_peer_error_promptly(tmp_path: Path) -> None:
    results = launch("dead", tmp_path, timeout=DEAD_TIMEOUT, only_rank0=True)
    r0 = results[0]
    assert r0 is not None and r0.get("ok"), logs(tmp_path)
    peer = r0["peer_address"]
    for check in ("all_gather_bytes", "training_step"):
        got = r0[check]
        assert got["type"] == "PeerError", (check, got)
        assert got["seconds"] < DEAD_TIMEOUT, f"{check} took {got['seconds']:.1f} s: it should fail, not wait"
        assert "rank 1 (worker:1 at " + peer + ")" in got["message"], got["message"]
        assert "closed its connection" in got["message"]
        assert got["peer_rank"] == 1
    # DDP's own all-reduce (no Python comm hook since issue 22) raises gloo's error from backward; the guard
    # around the step (the Trainer has one) is what names the peer, from that error.
    assert "Connection closed by peer" in r0["training_step"]["unguarded"]


@pytest.mark.timeout(90)
def test_silent_peer_times_out_within_the_configured_timeout(tmp_path: Path) -> None:
    results = launch("silent", tmp_path, timeout=SILENT_TIMEOUT, only_rank0=True)
    r0 = results[0]
    assert r0 is not None and r0.get("ok"), logs(tmp_path)
    got = r0["all_gather_bytes"]
    assert got["type"] == "PeerError" and got["timed_out"], got
    assert SILENT_TIMEOUT * 0.8 < got["seconds"] < SILENT_TIMEOUT + 3.0, got["seconds"]
    assert f"did not take part within the {SILENT_TIMEOUT:g} s timeout" in got["message"]
    assert "CONVEYOR_TIMEOUT" in got["message"]


# -- the worker side ------------------------------------------------------------------------------------------------


def payload(rank: int) -> bytes:
    return bytes([rank + 1]) * (1000 * rank + 3)  # different lengths, so the padding is exercised


def wait_for_everyone(out: Path, rank: int) -> None:
    """A file barrier before conveyor.init(): importing torch takes seconds and varies between processes, and
    the short rendezvous timeouts of the failure scenarios should measure collectives, not import skew."""
    (out / f"ready-{rank}").touch()
    end = time.monotonic() + 60
    while not all((out / f"ready-{r}").exists() for r in range(WORLD)):
        if time.monotonic() > end:
            raise TimeoutError("the other worker never started")
        time.sleep(0.02)


def attempt(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # record whatever it was: the test asserts the type
        kind = "PeerError" if isinstance(e, PeerError) else type(e).__name__
        return {"type": kind, "message": str(e), "seconds": time.monotonic() - start,
                "peer_rank": getattr(e, "peer_rank", None), "timed_out": getattr(e, "timed_out", None),
                "unguarded": str(e.__cause__) if e.__cause__ is not None else ""}
    return {"type": None, "seconds": time.monotonic() - start}


def run_train(job, out: Path) -> dict:
    rank = job.rank
    result: dict = {"strategy": str(job.strategy), "threads": torch.get_num_threads(),
                    "cores": len(os.sched_getaffinity(0))}

    # (1) different initialisation per rank, identical after prepare (parameters and buffers)
    model = make_mlp(seed=100 + rank)
    model.register_buffer("marker", torch.full((3,), float(rank)))
    before = flat(model)
    gathered = job.all_gather_bytes(before.numpy().tobytes())
    result["differed_before_prepare"] = len(set(gathered)) == WORLD
    ddp, _ = job.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    after = job.all_gather_bytes(flat(ddp).numpy().tobytes())
    result["identical_after_prepare"] = len(set(after)) == 1
    result["equal_to_rank0_init"] = after[0] == gathered[0]

    # (2) + (5): same seed everywhere, batch BATCH per worker, timed communication
    model = make_mlp(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ddp, same = job.prepare(model, optimizer)
    assert same is optimizer
    result["comm_before"] = job.strategy.step.comm_seconds()
    start = time.perf_counter()
    train(ddp, optimizer, rank=rank, world=WORLD, batch=BATCH)
    result["train_seconds"] = time.perf_counter() - start
    result["comm_after"] = job.strategy.step.comm_seconds()
    result["trained"] = flat(ddp).tolist()
    result.update(comm_per_step(job, ddp, optimizer))

    # (3) byte and tensor collectives
    result["all_gather"] = [b.hex() for b in job.all_gather_bytes(payload(rank))]
    result["all_gather_empty"] = [b.hex() for b in job.all_gather_bytes(b"")]
    result["broadcast_from_0"] = job.broadcast_bytes(b"rank zero says hi" if rank == 0 else None).hex()
    result["broadcast_from_1"] = job.broadcast_bytes(bytes(range(256)) if rank == 1 else None, src=1).hex()
    result["broadcast_empty"] = job.broadcast_bytes(b"" if rank == 0 else None).hex()
    result["all_reduce"] = {op: job.all_reduce(torch.tensor([rank + 1.0, 10.0 * (rank + 1)]), op).tolist()
                            for op in ("sum", "mean", "max", "min")}
    result["all_reduce_int_mean"] = job.all_reduce(torch.tensor([rank + 1]) * 2 - 1, "mean").tolist()  # (1+3)/2
    job.barrier()
    return result


def comm_per_step(job, ddp, optimizer) -> dict:
    """comm_seconds() read around single steps: each step adds its own, repeated reads and an evaluation
    forward (no gradient: DDP does not time it) add nothing; and no Python comm hook is on the buckets."""
    x, y = make_data()
    clock = job.strategy.step.comm_seconds
    steps = []
    for _ in range(3):
        before = clock()
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x[:BATCH]), y[:BATCH]).backward()
        optimizer.step()
        steps.append(clock() - before)
    settled = clock()
    with torch.no_grad():
        ddp(x[:BATCH])
    return {"comm_steps": steps, "comm_reads_agree": [settled, clock(), clock()],
            "comm_hook": ddp._get_ddp_logging_data().get("comm_hook")}


def run_failure(job, out: Path, scenario: str) -> dict:
    """Rank 1 dies ("dead") or stays silent ("silent") after a barrier; rank 0 records what its collectives do."""
    step = None
    if scenario == "dead":  # "silent" needs no model: DDP's first use imports torch._dynamo, seconds per process
        model = make_mlp(seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        ddp, _ = job.prepare(model, optimizer)
        x, y = make_data()

        def step() -> None:
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x[:BATCH]), y[:BATCH]).backward()
            optimizer.step()

        step()
        step()  # DDP rebuilds its buckets after the first step; from now on only the gradient all-reduce communicates
    job.barrier()
    if job.rank == 1:
        if scenario == "silent":
            time.sleep(SILENT_TIMEOUT + 1.5)  # alive but not taking part
        (out / "rank1.json").write_text(json.dumps({"ok": True}))
        os._exit(1)
    time.sleep(0.3)
    result = {"peer_address": job.cluster.task_address("worker", 1)}
    result["all_gather_bytes"] = attempt(lambda: job.all_gather_bytes(b"hello"))
    if step is not None:
        def guarded_step() -> None:
            with collective_guard(job, "training step"):
                step()
        result["training_step"] = attempt(guarded_step)
    return result


def worker_main(scenario: str, out: Path) -> None:
    rank = int(os.environ["RANK"])
    wait_for_everyone(out, rank)
    job = conveyor.init()
    if scenario == "train":
        with job:
            result = run_train(job, out)
    else:
        result = run_failure(job, out, scenario)  # no shutdown: the group is broken on purpose
    result["ok"] = True
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (a second or more once DDP has imported torch._dynamo)


if __name__ == "__main__":
    worker_main(sys.argv[1], Path(sys.argv[2]))
