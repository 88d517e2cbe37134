"""Where tasks go and what each task is told: hosts → task assignments → environment dicts.

All pure functions, in the spirit of Horovod's ``runner/common/util/hosts.py``: the launcher decides
*what* to start from these and only then starts processes, so the whole plan can be printed
(``conveyor run --dry-run``) and tested by exact equality without starting anything (STYLE habit 6)::

    spec = local_cluster(num_workers=2, num_ps=1, ports=[23001, 23002, 23003])
    env = task_environment(spec, TaskId("worker", 1), secret=b"...", data_dir="data", output_dir="out",
                           master_addr="127.0.0.1", master_port=23004, strategy="ps-async")
    # env["TF_CONFIG"], env["RANK"] == "1", env["CONVEYOR_TASK_TYPE"] == "worker", ...

A task's environment speaks three dialects at once so that one script runs under any of them:
TensorFlow's ``TF_CONFIG``, torch's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` (what ``torchrun`` sets, so ``init_process_group("env://")`` works), and
conveyor's own ``CONVEYOR_*`` variables, which carry what neither of the others has (strategy, data and
output folders, the job's message-signing secret).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.cluster.spec import ClusterConfigError, ClusterSpec, TaskId, join_address
from conveyor.cluster.variables import (  # conveyor's own variables, re-exported from their old home
    DATA_DIR_VAR,
    JOB_SECRET_VAR,
    OUTPUT_DIR_VAR,
    PIPELINE_VARS,
    STRATEGY_VAR,
    TASK_INDEX_VAR,
    TASK_TYPE_VAR,
)

__all__ = [
    "DATA_DIR_VAR",
    "JOB_SECRET_VAR",
    "OUTPUT_DIR_VAR",
    "PIPELINE_VARS",
    "STRATEGY_VAR",
    "TASK_INDEX_VAR",
    "TASK_TYPE_VAR",
    "TaskSlot",
    "assign_hosts",
    "local_cluster",
    "task_environment",
]


def task_environment(
    spec: ClusterSpec,
    task: TaskId,
    *,
    secret: bytes,
    data_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    master_addr: str,
    master_port: int,
    strategy: str,
    local_rank: int = 0,
    local_world_size: int = 1,
) -> dict[str, str]:
    """The variables the launcher sets for one task (added to the inherited environment).

    Every task gets ``TF_CONFIG`` (TensorFlow's exact JSON for this task) and ``CONVEYOR_TASK_TYPE``,
    ``CONVEYOR_TASK_INDEX``, ``CONVEYOR_STRATEGY``, ``CONVEYOR_DATA_DIR``, ``CONVEYOR_OUTPUT_DIR`` and
    ``CONVEYOR_JOB_SECRET`` (the secret in hex). Training tasks (chief, worker) also get torch's
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
    ps and evaluator tasks do not, because they are not members of the torch process group and a
    ``RANK`` on them would invite code to join it. ``master_addr`` is a bare host (no brackets, no port),
    as torch expects; ``local_rank``/``local_world_size`` count training tasks on the task's machine.
    """
    spec.check_task(task)
    if not isinstance(secret, bytes) or not secret:
        got = "empty bytes" if isinstance(secret, bytes) else type(secret).__name__  # never echo a secret
        raise ClusterConfigError(f"secret must be non-empty bytes (it signs the job's messages); got {got}")
    if not isinstance(strategy, str) or not strategy.strip():
        raise ClusterConfigError(f"strategy = {strategy!r}; expected a name such as 'allreduce' or 'ps-async'")
    env = {
        "TF_CONFIG": spec.to_tf_config(task.type, task.index),
        TASK_TYPE_VAR: task.type,
        TASK_INDEX_VAR: str(task.index),
        STRATEGY_VAR: strategy,
        DATA_DIR_VAR: os.fspath(data_dir),
        OUTPUT_DIR_VAR: os.fspath(output_dir),
        JOB_SECRET_VAR: secret.hex(),
    }
    if not task.is_training:
        return env
    if not isinstance(master_addr, str) or not master_addr or master_addr.startswith("[") or "/" in master_addr:
        raise ClusterConfigError(f"master_addr = {master_addr!r}; expected a bare host such as '10.0.0.1', "
                                 f"'node01' or '::1' (no port, no brackets)")
    _check_port(master_port, "master_port")
    world_size = spec.world_size
    if not _is_int(local_world_size) or not 1 <= local_world_size <= world_size:
        raise ClusterConfigError(f"local_world_size = {local_world_size!r}; expected 1..{world_size} "
                                 f"(training tasks on this machine, at most WORLD_SIZE)")
    if not _is_int(local_rank) or not 0 <= local_rank < local_world_size:
        raise ClusterConfigError(f"local_rank = {local_rank!r}; expected 0..{local_world_size - 1} "
                                 f"(below local_world_size={local_world_size})")
    env.update({
        "RANK": str(spec.rank_of(task)),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    })
    return env


def local_cluster(
    num_workers: int, num_ps: int, ports: Sequence[int], host: str = "127.0.0.1", chief: bool = False
) -> ClusterSpec:
    """A cluster on one machine: every task at ``host``, one port each from ``ports``.

    ``num_workers`` counts all training tasks, so ``WORLD_SIZE == num_workers`` either way; ``chief=True``
    makes the first of them the ``chief`` job (rank 0) instead of ``worker:0``. Ports are used in order:
    chief, workers, then ps, and there must be exactly one per task - the launcher reserves them and a
    mismatch means it miscounted.
    """
    if not _is_int(num_workers) or num_workers < 1:
        raise ClusterConfigError(f"num_workers = {num_workers!r}; expected at least 1 training task")
    if not _is_int(num_ps) or num_ps < 0:
        raise ClusterConfigError(f"num_ps = {num_ps!r}; expected 0 or more parameter servers")
    ports = list(ports)
    if len(ports) != num_workers + num_ps:
        raise ClusterConfigError(f"ports has {len(ports)} entries for {num_workers} workers + {num_ps} ps; "
                                 f"expected exactly {num_workers + num_ps}, one per task")
    for i, port in enumerate(ports):
        _check_port(port, f"ports[{i}]")
    addresses = [join_address(host, port) for port in ports]
    n_chief = 1 if chief else 0
    return ClusterSpec(
        chief=tuple(addresses[:n_chief]),
        worker=tuple(addresses[n_chief:num_workers]),
        ps=tuple(addresses[num_workers:]),
    )


@dataclass(frozen=True)
class TaskSlot:
    """One task placed on one host, with what torch needs to know about its neighbours.

    ``rank``, ``local_rank`` and ``local_world_size`` describe the training group and are ``None`` for ps
    tasks, which are not in it. ``node_rank`` is the host's position among the hosts that got tasks
    (torchrun's ``GROUP_RANK``).
    """

    host: str
    task: TaskId
    node_rank: int
    rank: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None


def assign_hosts(
    hosts: Sequence[tuple[str, int]], num_workers: int, num_ps: int, *, chief: bool = False
) -> dict[str, tuple[TaskSlot, ...]]:
    """Place ``num_workers`` training tasks and ``num_ps`` parameter servers on ``[(host, slots), ...]``.

    Training tasks fill the hosts in the order given, each up to its slots (slots are accelerators or
    cores; a host's training tasks get consecutive ranks and local ranks 0, 1, ...), as Horovod's
    ``hosts.py`` does. Filling host by host keeps neighbouring ranks on one machine, where ring
    all-reduce traffic between them stays off the network. Parameter servers take no slots (they hold
    variables on the CPU) and go round-robin over the hosts from the first, so that with one ps per
    machine each machine's network link carries an equal share of the parameter traffic.
    ``chief=True`` makes the first training task the ``chief`` (rank 0).

    Returns ``{host: (slots...)}`` for the hosts that got at least one task, in the order given; each
    host's tuple lists its training tasks in rank order, then its ps tasks.
    """
    if not _is_int(num_workers) or num_workers < 1:
        raise ClusterConfigError(f"num_workers = {num_workers!r}; expected at least 1 training task")
    if not _is_int(num_ps) or num_ps < 0:
        raise ClusterConfigError(f"num_ps = {num_ps!r}; expected 0 or more parameter servers")
    if not hosts:
        raise ClusterConfigError("hosts is empty; expected e.g. [('node01', 4), ('node02', 4)]")
    seen: set[str] = set()
    for i, entry in enumerate(hosts):
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise ClusterConfigError(f"hosts[{i}] = {entry!r}; expected a (host, slots) pair such as ('node01', 4)")
        host, slots = entry
        if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host):
            raise ClusterConfigError(f"hosts[{i}] host = {host!r}; expected a host name such as 'node01'")
        if not _is_int(slots) or slots < 1:
            raise ClusterConfigError(f"hosts[{i}] ({host}) has slots = {slots!r}; expected an integer >= 1")
        if host.lower() in seen:
            raise ClusterConfigError(f"hosts[{i}] = {host!r} is listed twice; list each host once with all its slots")
        seen.add(host.lower())
    capacity = sum(slots for _, slots in hosts)
    if capacity < num_workers:
        raise ClusterConfigError(f"{num_workers} workers do not fit in {capacity} slots on {len(hosts)} hosts; "
                                 f"ask for fewer workers or more hosts/slots")

    training: dict[str, list[tuple[int, TaskId]]] = {host: [] for host, _ in hosts}
    rank = 0
    for host, slots in hosts:
        for _ in range(min(slots, num_workers - rank)):
            task = TaskId("chief", 0) if chief and rank == 0 else TaskId("worker", rank - (1 if chief else 0))
            training[host].append((rank, task))
            rank += 1
    ps_on: dict[str, list[TaskId]] = {host: [] for host, _ in hosts}
    for i in range(num_ps):
        ps_on[hosts[i % len(hosts)][0]].append(TaskId("ps", i))

    out: dict[str, tuple[TaskSlot, ...]] = {}
    for host, _ in hosts:
        if not training[host] and not ps_on[host]:
            continue
        node_rank, local = len(out), len(training[host])
        slots_here = [TaskSlot(host, task, node_rank, r, i, local) for i, (r, task) in enumerate(training[host])]
        slots_here += [TaskSlot(host, task, node_rank) for task in ps_on[host]]
        out[host] = tuple(slots_here)
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_port(port: object, field: str) -> None:
    if not _is_int(port) or not 1 <= port <= 65535:
        raise ClusterConfigError(f"{field} = {port!r}; expected a port number 1-65535")
