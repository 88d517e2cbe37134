"""Shared by the multi-process tests: the environments of a local job's tasks, and waiting for the task
processes a test started, never forever."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import pytest

from conveyor.cluster import local_cluster, task_environment
from conveyor.cluster.variables import FAST_EXIT_VAR
from conveyor.launch.ports import PORT_RANGE_VAR, free_ports

# Variables that would make the tasks discover something other than what the test gives them.
_FOREIGN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG",
            "OMP_NUM_THREADS")


# How this machine runs processes, not which job they belong to: kept in a clean environment. Dropped, every task
# paid the slow exit (a CPU-second with torch._dynamo loaded) and a launcher took its ports outside the xdist
# worker's range (tests/conftest.py).
MACHINE_VARS = (FAST_EXIT_VAR, PORT_RANGE_VAR)
LAUNCHER_PREFIXES = ("CONVEYOR_", "SLURM_", "TORCHELASTIC_")


def launcher_var(name: str, prefixes: tuple[str, ...] = LAUNCHER_PREFIXES) -> bool:
    """Whether ``name`` is an outer launcher's or job's variable, which a clean environment drops."""
    return name.startswith(prefixes) and name not in MACHINE_VARS


def local_job_envs(out: Path, world: int, strategy: str, *, gpus: bool = False) -> list[dict[str, str]]:
    """Each training task's environment for a one-machine job of ``world`` tasks, as `conveyor run` gives it:
    this process's environment without any launcher's variables, plus the task's own.

    Without ``gpus`` the tasks see no GPU, so that a test comparing with a CPU reference trains on the CPU on a
    GPU host too; the tests written for GPUs ask for them."""
    ports = free_ports(world + 1)
    spec = local_cluster(num_workers=world, num_ps=0, ports=ports[:world])
    base = {k: v for k, v in os.environ.items()
            if k not in _FOREIGN and not launcher_var(k)}
    if not gpus:
        base["CUDA_VISIBLE_DEVICES"] = ""
    return [base | task_environment(spec, task, secret=b"test-secret", data_dir=out / "data",
                                    output_dir=out / "output", master_addr="127.0.0.1", master_port=ports[world],
                                    strategy=strategy, local_rank=rank, local_world_size=world)
            for rank, task in enumerate(spec.training_tasks)]


def wait_all(procs: Sequence[tuple[subprocess.Popen, IO]], deadline: float, what: str,
             logs: Callable[[], str]) -> None:
    """Wait for every process up to `deadline` seconds in all; on time-out fail the test with the
    logs. Whatever still runs afterwards is killed, and every log file is closed."""
    end = time.monotonic() + deadline
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(0.1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: still running after {deadline:g} s\n{logs()}")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
