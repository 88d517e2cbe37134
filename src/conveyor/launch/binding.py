"""`conveyor run --bind none|core|socket`: which CPUs each of this machine's tasks may run on, decided purely.

    machine = CpuTopology.read()              # /sys/devices/system/cpu + the launcher's own affinity
    places = bind_cpus(machine, tasks=4, mode="core")   # per task: its cpus and its OpenMP thread count
    format_cpus(places[0].cpus)               # "0-3,16-19"

A *core* is a physical core: its hyperthread siblings always go to the same task. Only the CPUs the
launcher itself may use (``os.sched_getaffinity(0)``: a cgroup, Slurm's or numactl's binding) are
handed out. ``core`` gives every task the same number of whole cores, packed socket by socket (a task
straddles two sockets only when the share does not fit the sockets' sizes); the cores left over by
the division stay free for the launcher and the system. More tasks than cores is an error: a bound
task that shares its core runs at half speed without saying so. ``socket`` gives task i every
allowed CPU of socket ``i mod sockets`` (Open MPI's and Horovod's ``--map-by socket --bind-to socket``):
tasks beyond the socket count share a socket, and split its physical cores for their thread count.
``none`` binds nothing. The supervisor applies a task's set between fork and exec, so every thread and
child process of the task inherits it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BIND_MODES", "Cpu", "CpuTopology", "TaskCpus", "bind_cpus", "format_cpus", "parse_cpu_list"]

BIND_MODES: tuple[str, ...] = ("none", "core", "socket")
SYSFS_CPUS = "/sys/devices/system/cpu"


@dataclass(frozen=True)
class Cpu:
    """One logical CPU: its id, its socket (``physical_package_id``) and its physical core, named by the
    lowest CPU id among its hyperthread siblings (unique on the machine, whatever ``core_id`` repeats)."""

    id: int
    socket: int
    core: int


@dataclass(frozen=True)
class TaskCpus:
    """One task's placement: the CPUs it may run on and the intra-op (OpenMP) threads it should use."""

    cpus: tuple[int, ...]
    threads: int


@dataclass(frozen=True)
class CpuTopology:
    """The machine's CPUs and the ones this process may run on."""

    cpus: tuple[Cpu, ...]
    allowed: frozenset[int]

    @classmethod
    def read(cls, root: str | os.PathLike = SYSFS_CPUS, allowed: Iterable[int] | None = None) -> CpuTopology:
        """This machine's topology from sysfs; ``allowed`` defaults to this process's affinity."""
        mask = frozenset(os.sched_getaffinity(0) if allowed is None else allowed)
        cpus = []
        for cpu_id in sorted(mask):
            topo = Path(root) / f"cpu{cpu_id}" / "topology"
            socket = _read_int(topo / "physical_package_id")
            siblings = _read_list(topo / "core_cpus_list") or _read_list(topo / "thread_siblings_list")
            # no sysfs (some containers): every CPU counts as a core of its own, on one socket
            cpus.append(Cpu(cpu_id, socket if socket is not None and socket >= 0 else 0,
                            min(siblings) if siblings else cpu_id))
        return cls(tuple(cpus), mask)

    def cores(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Allowed CPUs by physical core ``(socket, core)``, in socket and core order."""
        out: dict[tuple[int, int], list[int]] = {}
        for cpu in sorted(self.cpus, key=lambda c: (c.socket, c.core, c.id)):
            if cpu.id in self.allowed:
                out.setdefault((cpu.socket, cpu.core), []).append(cpu.id)
        return {key: tuple(ids) for key, ids in out.items()}


def bind_cpus(topology: CpuTopology, tasks: int, mode: str) -> tuple[TaskCpus, ...] | None:
    """Each of ``tasks`` tasks' CPUs under ``mode`` (see the module's text); None for ``none``."""
    if mode not in BIND_MODES:
        raise ValueError(f"--bind {mode!r}: expected one of {', '.join(BIND_MODES)}")
    if mode == "none" or tasks < 1:
        return None
    cores = topology.cores()
    if not cores:
        raise ValueError("--bind: none of this machine's CPUs is allowed to the launcher; run with --bind none")
    return _by_core(cores, tasks) if mode == "core" else _by_socket(cores, tasks)


def _by_core(cores: dict[tuple[int, int], tuple[int, ...]], tasks: int) -> tuple[TaskCpus, ...]:
    if tasks > len(cores):
        cpus = sorted(c for ids in cores.values() for c in ids)
        raise ValueError(f"--bind core: {tasks} tasks on this machine but the launcher may use only {len(cores)} "
                         f"physical core(s) (cpus {format_cpus(cpus)}), so tasks would share cores; run at most "
                         f"{len(cores)} tasks per machine, or use --bind socket (tasks share their socket's cores) "
                         f"or --bind none")
    share = len(cores) // tasks
    chunks: list[list[tuple[int, int]]] = []
    spare: list[tuple[int, int]] = []
    for socket in sorted({key[0] for key in cores}):
        mine = [key for key in cores if key[0] == socket]
        whole = len(mine) // share
        chunks += [mine[i * share:(i + 1) * share] for i in range(whole)]
        spare += mine[whole * share:]
    # the sockets' remainders, pooled: only these chunks straddle sockets
    chunks += [spare[i * share:(i + 1) * share] for i in range(len(spare) // share)]
    return tuple(TaskCpus(tuple(sorted(c for key in chunk for c in cores[key])), share) for chunk in chunks[:tasks])


def _by_socket(cores: dict[tuple[int, int], tuple[int, ...]], tasks: int) -> tuple[TaskCpus, ...]:
    sockets = sorted({key[0] for key in cores})
    out = []
    for i in range(tasks):
        socket = sockets[i % len(sockets)]
        sharing = len(range(i % len(sockets), tasks, len(sockets)))  # tasks on this socket
        physical = [ids for key, ids in cores.items() if key[0] == socket]
        out.append(TaskCpus(tuple(sorted(c for ids in physical for c in ids)), max(1, len(physical) // sharing)))
    return tuple(out)


def format_cpus(cpus: Iterable[int]) -> str:
    """``0-3,8,10-11``: the kernel's cpu-list format (``taskset -c``, ``/proc/self/status``)."""
    ids = sorted(set(cpus))
    parts = []
    start = prev = None
    for c in [*ids, None]:
        if c is not None and prev is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = c
    return ",".join(parts)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The inverse of :func:`format_cpus` (``0-3,8``), as sysfs writes it."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        out += range(int(low), int(high or low) + 1)
    return tuple(out)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_list(path: Path) -> Sequence[int]:
    try:
        return parse_cpu_list(path.read_text())
    except (OSError, ValueError):
        return ()
