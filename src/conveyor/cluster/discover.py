"""Who am I? A task's identity, read from whatever started the process.

``discover()`` looks at the environment in this order and takes the first source that is present:

1. ``conveyor``  - conveyor's launcher: ``CONVEYOR_TASK_TYPE`` plus the ``TF_CONFIG`` and torch variables
   it wrote (all checked against each other; a disagreement means the environment was edited);
2. ``tf_config`` - ``TF_CONFIG`` alone: Kubeflow's TFJob, Vertex AI, a hand-written TensorFlow cluster;
3. ``torchrun``  - ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``: torchrun, Kubeflow's PyTorchJob;
4. ``mpi``       - ``OMPI_COMM_WORLD_*`` (Open MPI's mpirun) or ``PMI_RANK``/``MPI_LOCALRANKID`` (MPICH's and
   Intel MPI's Hydra): ``mpirun -np N python train.py``;
5. ``slurm``     - ``SLURM_PROCID`` and friends: a script started by ``srun``;
6. ``single``    - nothing: one local worker, rank 0 of 1, so a script runs unchanged with no launcher.

The most specific source wins: conveyor's launcher also writes the torch variables, torchrun run
inside a Slurm allocation inherits the ``SLURM_*`` ones, and so does mpirun, whose processes inherit
the ``SLURM_PROCID`` of the daemon srun started on their node; the source that started *this*
process is the one that knows its rank. ``environ`` is a parameter so that tests (and ``--dry-run``) can discover from
a dict; nothing here reads ``os.environ`` unless asked to, and nothing writes it.

Malformed values raise :class:`ClusterConfigError` naming the variable and the fix: a wrong rank would
not fail here but minutes later as a hang in the first collective, far from its cause.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from conveyor.cluster.spec import (
    JOBS,
    MAX_HOST_CHARS,
    MAX_INDEX,
    ClusterConfigError,
    ClusterSpec,
    TaskId,
    host_problem,
    parse_decimal,
    parse_host,
    parse_tf_config,
    show,
    split_address,
)
from conveyor.cluster.variables import (
    DATA_DIR_VAR,
    JOB_SECRET_VAR,
    OUTPUT_DIR_VAR,
    STRATEGY_VAR,
    TASK_INDEX_VAR,
    TASK_TYPE_VAR,
)

__all__ = ["SOURCES", "Discovered", "discover", "expand_hostlist", "expand_tasks_per_node", "slurm_port"]

SOURCES: tuple[str, ...] = ("conveyor", "tf_config", "torchrun", "mpi", "slurm", "single")

#: The port range a Slurm job's rendezvous port is derived into when MASTER_PORT is not set: above the
#: well-known and common service ports, below the Linux ephemeral range (32768+), so it does not collide
#: with ports the kernel hands out to outgoing connections.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000

_MAX_HOSTS = 100_000  # a host list that expands beyond this is a typo ("node[0-9999999]"), not a cluster
_MAX_JOB_ID = 2**32 - 1  # Slurm's job ids are uint32_t
_HOST_FIX = "set it to rank 0's host name or IP address alone (its port goes in MASTER_PORT)"


@dataclass(frozen=True)
class Discovered:
    """This process's place in the job, whichever source described it.

    ``rank`` is ``None`` on ps and evaluator tasks: they are not members of the training process group.
    ``world_size`` is the number of training tasks (also on a ps, which needs to know how many workers
    to serve). ``master_addr``/``master_port`` are where rank 0's rendezvous store listens; ``None``
    where there is no group to join (a ps, or a single process), and under MPI without ``MASTER_ADDR``/
    ``MASTER_PORT``, which ``conveyor.init()`` then agrees on through MPI. ``spec`` is the TF-style
    cluster when the source has one (conveyor, tf_config), ``None`` for torchrun, MPI and Slurm, whose
    tasks are all workers.
    ``strategy``, ``data_dir``, ``output_dir`` and ``secret`` come from the ``CONVEYOR_*`` variables when
    set (under any source), so callers never read those variables themselves.
    """

    spec: ClusterSpec | None
    task: TaskId
    rank: int | None
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    source: str
    strategy: str | None = None
    data_dir: str | None = None
    output_dir: str | None = None
    secret: bytes | None = field(default=None, repr=False)  # kept out of repr so it never lands in a log

    @property
    def is_chief(self) -> bool:
        """Rank 0: the chief task when the cluster has one, else worker 0 (TensorFlow's rule)."""
        return self.rank == 0


def discover(environ: Mapping[str, str] | None = None) -> Discovered:
    """Read this task's identity from ``environ`` (default: ``os.environ``); see the module docstring."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    extras = _conveyor_extras(env)
    if TASK_TYPE_VAR in env:
        return _from_conveyor(env, extras)
    tf_config = _tf_config_of(env)
    if tf_config is not None:
        return _from_tf_config(env, tf_config, extras)
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env, extras)
    mpi = _mpi_launchers(env)
    if mpi:
        return _from_mpi(env, mpi, extras)
    if "SLURM_PROCID" in env:
        return _from_slurm(env, extras)
    return Discovered(spec=None, task=TaskId("worker", 0), rank=0, world_size=1, local_rank=0, local_world_size=1,
                      master_addr=None, master_port=None, source="single", **extras)


# -- sources ---------------------------------------------------------------------------------------


def _from_conveyor(env: Mapping[str, str], extras: dict) -> Discovered:
    if _tf_config_of(env) is None:
        raise ClusterConfigError(f"{TASK_TYPE_VAR} is set but TF_CONFIG is not: conveyor's launcher sets both. "
                                 f"Start the script with `conveyor run`, or unset {TASK_TYPE_VAR}")
    spec, task = parse_tf_config(env["TF_CONFIG"])
    if env[TASK_TYPE_VAR] not in JOBS:
        raise ClusterConfigError(f"{TASK_TYPE_VAR}={show(env[TASK_TYPE_VAR])} is not a job; conveyor's launcher "
                                 f"sets one of {', '.join(JOBS)}: unset the CONVEYOR_* variables or fix it")
    index = _int_var(env, TASK_INDEX_VAR, f"conveyor's launcher sets it with {TASK_TYPE_VAR}")
    if (env[TASK_TYPE_VAR], index) != (task.type, task.index):
        raise ClusterConfigError(f"{TASK_TYPE_VAR}={env[TASK_TYPE_VAR]}, {TASK_INDEX_VAR}={index} disagree with "
                                 f"TF_CONFIG's task {task}; the launcher writes them together, so one was "
                                 f"changed afterwards: unset the CONVEYOR_* variables or fix TF_CONFIG")
    if not task.is_training:
        return _non_training(spec, task, "conveyor", extras)
    fix = "conveyor's launcher sets it on chief and worker tasks; start the script with `conveyor run`"
    rank, world_size = _int_var(env, "RANK", fix), _int_var(env, "WORLD_SIZE", fix)
    _check_agrees(spec, task, rank, world_size, "TF_CONFIG")
    local_rank, local_world_size = _local(env, world_size)
    addr = parse_host(_require(env, "MASTER_ADDR", fix), "MASTER_ADDR", _HOST_FIX)
    port = _port_var(env, "MASTER_PORT", _require(env, "MASTER_PORT", fix))
    return Discovered(spec, task, rank, world_size, local_rank, local_world_size, addr, port, "conveyor", **extras)


def _from_tf_config(env: Mapping[str, str], tf_config: str, extras: dict) -> Discovered:
    spec, task = parse_tf_config(tf_config)
    if not task.is_training:
        return _non_training(spec, task, "tf_config", extras)
    rank, world_size = spec.rank_of(task), spec.world_size
    if "RANK" in env or "WORLD_SIZE" in env:  # e.g. a TF_CONFIG left over in a torchrun job: refuse to guess
        fix = "they come from different launchers; unset the stale ones"
        _check_agrees(spec, task, _int_var(env, "RANK", fix) if "RANK" in env else rank,
                      _int_var(env, "WORLD_SIZE", fix) if "WORLD_SIZE" in env else world_size, "TF_CONFIG")
    local_rank, local_world_size = _local(env, world_size)
    # Without MASTER_ADDR/MASTER_PORT, rank 0's own TF_CONFIG address is the rendezvous point: it is the
    # one port the orchestrator reserved for that task and exposed to every peer (Kubeflow gives it a
    # Service), and no TensorFlow server is started on it here.
    host, port = split_address(spec.task_address(*_rank0(spec)))
    addr = _optional_host(env, "MASTER_ADDR") or host
    if env.get("MASTER_PORT"):
        port = _port_var(env, "MASTER_PORT", env["MASTER_PORT"])
    return Discovered(spec, task, rank, world_size, local_rank, local_world_size, addr, port, "tf_config", **extras)


def _from_torchrun(env: Mapping[str, str], extras: dict) -> Discovered:
    fix = "torchrun sets RANK and WORLD_SIZE together; set both or neither"
    rank, world_size = _int_var(env, "RANK", fix), _int_var(env, "WORLD_SIZE", fix)
    _check_rank(rank, world_size, "RANK", "WORLD_SIZE")
    local_rank, local_world_size = _local(env, world_size)
    addr, port = _master(env, world_size, "torchrun sets it; for a hand-made launch set MASTER_ADDR=<rank 0's host> "
                                          "and MASTER_PORT=<a free port there>")
    return Discovered(None, TaskId("worker", rank), rank, world_size, local_rank, local_world_size, addr, port,
                      "torchrun", **extras)


def _from_mpi(env: Mapping[str, str], launchers: list[_MpiVars], extras: dict) -> Discovered:
    read = [_mpi_identity(env, names) for names in launchers]
    rank, world_size, local_rank, local_world_size = read[0]
    if len(read) > 1 and read[0][:2] != read[1][:2]:
        (a, b), (c, d) = launchers[0][1:3], launchers[1][1:3]
        raise ClusterConfigError(f"{a}={read[0][0]}, {b}={read[0][1]} ({launchers[0][0]}) disagree with {c}="
                                 f"{read[1][0]}, {d}={read[1][1]} ({launchers[1][0]}): one of them is left over from "
                                 f"another launcher; unset the stale ones")
    # Unset: conveyor.init() agrees on them through MPI itself (conveyor.comm.mpi_rendezvous), or says what to set.
    addr = _optional_host(env, "MASTER_ADDR")
    port = _port_var(env, "MASTER_PORT", env["MASTER_PORT"]) if env.get("MASTER_PORT") else None
    return Discovered(None, TaskId("worker", rank), rank, world_size, local_rank, local_world_size, addr, port,
                      "mpi", **extras)


def _from_slurm(env: Mapping[str, str], extras: dict) -> Discovered:
    fix = "srun sets it for every task; start the script with srun inside the allocation"
    rank = _int_var(env, "SLURM_PROCID", fix)
    world_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world_size = _int_var(env, world_name, fix)
    _check_rank(rank, world_size, "SLURM_PROCID", world_name)
    local_rank = _int_var(env, "SLURM_LOCALID", fix) if "SLURM_LOCALID" in env or world_size > 1 else 0
    node_id = _int_var(env, "SLURM_NODEID", fix) if "SLURM_NODEID" in env else 0

    local_world_size = local_rank + 1  # a lower bound, used only when Slurm does not say
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in env:
            counts = expand_tasks_per_node(env[name], name=name)
            if node_id >= len(counts):
                raise ClusterConfigError(f"SLURM_NODEID={node_id} but {name}={show(env[name])} lists {len(counts)} "
                                         f"nodes; the two come from different job steps")
            local_world_size = counts[node_id]
            break
    else:
        if "SLURM_NTASKS_PER_NODE" in env:
            local_world_size = _int_var(env, "SLURM_NTASKS_PER_NODE", fix)
    _check_local(local_rank, local_world_size, world_size, "SLURM_LOCALID", "tasks on this node")

    nodes: list[str] = []
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            nodes = expand_hostlist(env[name], name=name)
            break
    addr = _optional_host(env, "MASTER_ADDR") or (nodes[0] if nodes else None)
    if env.get("MASTER_PORT"):
        port: int | None = _port_var(env, "MASTER_PORT", env["MASTER_PORT"])
    else:
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        port = slurm_port(job_id) if job_id else None
    if world_size > 1 and addr is None:
        raise ClusterConfigError("cannot tell rank 0's host: SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are unset; "
                                 "run under srun, or set MASTER_ADDR")
    if world_size > 1 and port is None:
        raise ClusterConfigError("cannot pick a rendezvous port: neither MASTER_PORT nor SLURM_JOB_ID is set; "
                                 "set MASTER_PORT to a free port on rank 0's node")
    return Discovered(None, TaskId("worker", rank), rank, world_size, local_rank, local_world_size, addr, port,
                      "slurm", **extras)


def _non_training(spec: ClusterSpec, task: TaskId, source: str, extras: dict) -> Discovered:
    return Discovered(spec, task, None, spec.world_size, 0, 1, None, None, source, **extras)


# -- MPI launchers ---------------------------------------------------------------------------------

_MpiVars = tuple[str, str, str, str, str]  # who sets them; rank, size, local rank, local size

#: Open MPI's mpirun (``OMPI_COMM_WORLD_NODE_RANK`` counts across all jobs on the node, so it is not read),
#: then Hydra, the mpiexec of MPICH and Intel MPI (``PMI_RANK``/``PMI_SIZE``, and the local pair
#: the Hydra proxy of each node sets).
_MPI_LAUNCHERS: tuple[_MpiVars, ...] = (
    ("Open MPI's mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("Hydra's mpiexec", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _mpi_launchers(env: Mapping[str, str]) -> list[_MpiVars]:
    """The MPI launchers whose variables are set, in the order of :data:`_MPI_LAUNCHERS`.

    ``PMI_RANK``/``PMI_SIZE`` without Hydra's local pair but with ``SLURM_PROCID`` are srun's own PMI-2
    plugin (``srun --mpi=pmi2``): srun started the process, and only Slurm's variables say how many of
    the job's tasks share its node, so the slurm source describes it.
    """
    found = []
    for names in _MPI_LAUNCHERS:
        if not any(name in env for name in names[1:]):
            continue
        if names[1] == "PMI_RANK" and "SLURM_PROCID" in env and not (names[3] in env or names[4] in env):
            continue
        found.append(names)
    return found


def _mpi_identity(env: Mapping[str, str], names: _MpiVars) -> tuple[int, int, int, int]:
    who, rank_name, size_name, local_rank_name, local_size_name = names
    fix = f"{who} sets it in every process it starts; start the script with it, or unset {rank_name} and the rest"
    rank, world_size = _int_var(env, rank_name, fix), _int_var(env, size_name, fix)
    _check_rank(rank, world_size, rank_name, size_name)
    local_rank = _int_var(env, local_rank_name, fix) if local_rank_name in env else 0
    local_world_size = _int_var(env, local_size_name, fix) if local_size_name in env else local_rank + 1
    _check_local(local_rank, local_world_size, world_size, local_rank_name, local_size_name)
    return rank, world_size, local_rank, local_world_size


# -- Slurm formats ---------------------------------------------------------------------------------


def expand_hostlist(hostlist: str, *, name: str = "hostlist") -> list[str]:
    """Expand a Slurm host list: ``"node[01-03,07],gpu5"`` → ``["node01", "node02", "node03", "node07", "gpu5"]``.

    The format of ``SLURM_JOB_NODELIST``: comma-separated items, each a prefix with bracketed lists of
    numbers and ranges. A range keeps the zero padding of its low end (``[08-10]`` → 08, 09, 10), as
    Slurm's own hostlist code does; several brackets in one name expand with the first varying slowest
    (``r[1-2]n[1-2]`` → r1n1, r1n2, r2n1, r2n2). Order is kept and nothing is sorted, because the first
    node is the one Slurm starts rank 0 on. ``name`` is the variable named in errors. Stdlib only: no
    ``scontrol show hostnames`` subprocess, so it works in a container without Slurm's tools.
    """
    if not isinstance(hostlist, str):
        raise ClusterConfigError(f"{name} = {show(hostlist)}; expected a Slurm host list such as 'node[01-03,07],gpu5'")
    hosts: list[str] = []
    for item in _split_hostlist(hostlist, name):
        hosts.extend(_expand_host(item, hostlist, name))
        if len(hosts) > _MAX_HOSTS:
            raise _hostlist_error(name, hostlist, f"it expands to more than {_MAX_HOSTS} hosts; check the ranges")
    return hosts


def _hostlist_error(name: str, hostlist: str, problem: str) -> ClusterConfigError:
    return ClusterConfigError(f"{name} = {show(hostlist)}: {problem}; expected a Slurm host list such as "
                              f"'node[01-03,07],gpu5'")


def _split_hostlist(hostlist: str, name: str) -> list[str]:
    """Split at commas and whitespace outside brackets."""
    items, current, depth = [], [], 0
    for ch in hostlist:
        if ch == "[":
            if depth:
                raise _hostlist_error(name, hostlist, "brackets cannot nest")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _hostlist_error(name, hostlist, "']' without '['")
            depth = 0
        elif depth == 0 and (ch == "," or ch.isspace()):
            items.append("".join(current))
            current = []
            continue
        current.append(ch)
    if depth:
        raise _hostlist_error(name, hostlist, "'[' is never closed")
    items.append("".join(current))
    return [item for item in items if item]


def _expand_host(item: str, hostlist: str, name: str) -> list[str]:
    parts: list[list[str]] = []  # literal text and bracket expansions, in order; the product is the hosts
    pos = 0
    while pos < len(item):
        start = item.find("[", pos)
        if start < 0:
            parts.append([item[pos:]])
            break
        if start > pos:
            parts.append([item[pos:start]])
        end = item.index("]", start)  # _split_hostlist has checked the brackets pair up
        parts.append(_expand_ids(item[start + 1:end], hostlist, name))
        pos = end + 1
    count = 1
    for options in parts:
        count *= len(options)
    if count > _MAX_HOSTS:
        raise _hostlist_error(name, hostlist, f"it expands to more than {_MAX_HOSTS} hosts; check the ranges")
    if sum(max(map(len, options)) for options in parts) > MAX_HOST_CHARS:
        raise _hostlist_error(name, hostlist, f"a host name would be longer than {MAX_HOST_CHARS} characters")
    hosts = ["".join(combo) for combo in itertools.product(*parts)]
    # the brackets put only digits in, so the first name shows any character a resolver would refuse
    problem = host_problem(hosts[0], allow_ipv6=False) if hosts else None
    if problem:
        raise _hostlist_error(name, hostlist, problem)
    return hosts


def _expand_ids(ids: str, hostlist: str, name: str) -> list[str]:
    out: list[str] = []
    for piece in ids.split(","):
        piece = piece.strip()
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", piece)
        if m is None:
            raise _hostlist_error(name, hostlist, f"[{show(ids)[1:-1]}] has {show(piece)}, which is not a number "
                                                  f"or a range lo-hi")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        if max(len(lo_text), len(hi_text)) > MAX_HOST_CHARS:  # also keeps int() under its 4300-digit limit
            raise _hostlist_error(name, hostlist, f"a host name would be longer than {MAX_HOST_CHARS} characters")
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise _hostlist_error(name, hostlist, f"the range {show(piece)} runs backwards")
        if hi - lo >= _MAX_HOSTS:
            raise _hostlist_error(name, hostlist, f"the range {show(piece)} has more than {_MAX_HOSTS} hosts")
        if len(out) + hi - lo >= _MAX_HOSTS:  # checked before expanding: many ranges in one bracket add up
            raise _hostlist_error(name, hostlist, f"it expands to more than {_MAX_HOSTS} hosts; check the ranges")
        out.extend(str(n).zfill(len(lo_text)) for n in range(lo, hi + 1))
    return out


def expand_tasks_per_node(value: str, *, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand Slurm's tasks-per-node list: ``"2(x3),1"`` → ``[2, 2, 2, 1]`` (one count per node, in node order)."""
    counts: list[int] = []
    for piece in value.split(","):
        m = re.fullmatch(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*", piece)
        count = parse_decimal(m.group(1), MAX_INDEX) if m else None
        if not count or (m.group(2) is not None and not m.group(2).strip("0")):
            raise ClusterConfigError(f"{name} = {show(value)}: {show(piece)} is not a count such as '2' or '2(x3)'; "
                                     f"expected e.g. '2(x3),1'")
        repeat = parse_decimal(m.group(2) or "1", _MAX_HOSTS)  # None: more nodes than any allocation
        if repeat is None or len(counts) + repeat > _MAX_HOSTS:
            raise ClusterConfigError(f"{name} = {show(value)} lists more than {_MAX_HOSTS} nodes")
        counts.extend([count] * repeat)
    return counts


def slurm_port(job_id: str) -> int:
    """The rendezvous port for a Slurm job that did not set MASTER_PORT: 20000 + job id mod 10000.

    Every task of the job computes the same port without talking to the others, and two jobs sharing
    a node get different ports unless their ids are 10000 apart.
    """
    text = job_id.strip()
    if not (text.isascii() and text.isdigit()):
        raise ClusterConfigError(f"SLURM_JOB_ID = {show(job_id)} is not a number; set MASTER_PORT to a free port "
                                 f"instead")
    job = parse_decimal(text, _MAX_JOB_ID)
    if job is None:
        raise ClusterConfigError(f"SLURM_JOB_ID = {show(job_id)} is larger than any Slurm job id ({_MAX_JOB_ID}); "
                                 f"set MASTER_PORT to a free port instead")
    return SLURM_PORT_BASE + job % SLURM_PORT_SPAN


# -- reading variables ----------------------------------------------------------------------------


_EMPTY_JSON_OBJECT_RE = re.compile(r"[ \t\n\r]*\{[ \t\n\r]*\}[ \t\n\r]*")  # "{}" with JSON's whitespace


def _tf_config_of(env: Mapping[str, str]) -> str | None:
    """TF_CONFIG's text, or None when it is absent, blank or ``{}`` (TensorFlow reads those as "no cluster")."""
    text = env.get("TF_CONFIG")
    if text is None or not text.strip() or _EMPTY_JSON_OBJECT_RE.fullmatch(text):
        return None
    return text  # parse_tf_config reports whatever is wrong with it


def _conveyor_extras(env: Mapping[str, str]) -> dict:
    extras: dict = {
        "strategy": env.get(STRATEGY_VAR) or None,
        "data_dir": env.get(DATA_DIR_VAR) or None,
        "output_dir": env.get(OUTPUT_DIR_VAR) or None,
    }
    if JOB_SECRET_VAR in env:
        try:
            extras["secret"] = bytes.fromhex(env[JOB_SECRET_VAR])
        except ValueError:
            extras["secret"] = b""
        if not extras["secret"]:  # the value is not echoed: it is a secret
            raise ClusterConfigError(f"{JOB_SECRET_VAR} is not a non-empty hex string (as conveyor's launcher "
                                     f"writes it, e.g. 64 hex digits); unset it or copy it again")
    return extras


def _require(env: Mapping[str, str], name: str, fix: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise ClusterConfigError(f"{name} is empty or not set; {fix}")
    return value


def _optional_host(env: Mapping[str, str], name: str) -> str | None:
    """The host in ``name``, or None when it is unset or empty (the source's own default applies)."""
    return parse_host(env[name], name, _HOST_FIX) if env.get(name) else None


def _int_var(env: Mapping[str, str], name: str, fix: str) -> int:
    text = _require(env, name, fix)
    value = parse_decimal(text, MAX_INDEX)
    if value is None:
        raise ClusterConfigError(f"{name}={show(text)} is not a whole number >= 0 (at most {MAX_INDEX}); {fix}")
    return value


def _port_var(env: Mapping[str, str], name: str, text: str) -> int:
    port = parse_decimal(text.strip(), 65535)
    if not port:
        raise ClusterConfigError(f"{name}={show(text.strip())} is not a port number 1-65535; set it to a free port "
                                 f"on rank 0's host, e.g. {name}=29500")
    return port


def _local(env: Mapping[str, str], world_size: int) -> tuple[int, int]:
    """LOCAL_RANK (default 0: one process per pod, as Kubeflow's PyTorchJob runs) and LOCAL_WORLD_SIZE
    (default LOCAL_RANK + 1, a lower bound, for launchers that set only LOCAL_RANK)."""
    fix = "it counts this machine's training processes from 0, as torchrun sets it"
    local_rank = _int_var(env, "LOCAL_RANK", fix) if "LOCAL_RANK" in env else 0
    local_world_size = _int_var(env, "LOCAL_WORLD_SIZE", fix) if "LOCAL_WORLD_SIZE" in env else local_rank + 1
    _check_local(local_rank, local_world_size, world_size, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return local_rank, local_world_size


def _check_local(local_rank: int, local_world_size: int, world_size: int, rank_name: str, size_name: str) -> None:
    if local_rank >= local_world_size:
        raise ClusterConfigError(f"{rank_name}={local_rank} but {size_name} is {local_world_size}: a local rank "
                                 f"is 0..{local_world_size - 1}; fix whichever is wrong")
    if local_world_size > world_size:
        raise ClusterConfigError(f"{size_name} is {local_world_size} but the job has only {world_size} training "
                                 f"processes; fix whichever is wrong")


def _check_rank(rank: int, world_size: int, rank_name: str, size_name: str) -> None:
    if world_size < 1:
        raise ClusterConfigError(f"{size_name}={world_size}; a job has at least 1 process")
    if rank >= world_size:
        raise ClusterConfigError(f"{rank_name}={rank} but {size_name}={world_size}: ranks are 0..{world_size - 1}; "
                                 f"fix whichever is wrong")


def _check_agrees(spec: ClusterSpec, task: TaskId, rank: int, world_size: int, what: str) -> None:
    expected_rank, expected_world = spec.rank_of(task), spec.world_size
    if (rank, world_size) != (expected_rank, expected_world):
        raise ClusterConfigError(f"RANK={rank}, WORLD_SIZE={world_size} disagree with {what}, which makes task {task} "
                                 f"rank {expected_rank} of {expected_world}; unset RANK/WORLD_SIZE or fix {what}")


def _master(env: Mapping[str, str], world_size: int, fix: str) -> tuple[str | None, int | None]:
    """MASTER_ADDR/MASTER_PORT: required when there are peers to meet, optional for a group of one."""
    if world_size > 1:
        addr = parse_host(_require(env, "MASTER_ADDR", fix), "MASTER_ADDR", _HOST_FIX)
        return addr, _port_var(env, "MASTER_PORT", _require(env, "MASTER_PORT", fix))
    addr = _optional_host(env, "MASTER_ADDR")
    port = _port_var(env, "MASTER_PORT", env["MASTER_PORT"]) if env.get("MASTER_PORT") else None
    return addr, port


def _rank0(spec: ClusterSpec) -> tuple[str, int]:
    task = spec.training_tasks[0]
    return task.type, task.index
