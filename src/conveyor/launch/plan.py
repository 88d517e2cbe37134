"""What `conveyor run` starts on this machine: a pure plan, built before anything is started.

    options = RunOptions(script="train.py", script_args=("--epochs", "1"), workers=2,
                         data_dir="/abs/data", output_dir="/abs/output")
    plan = local_plan(options, ports=[23001, 23002], master_port=23003, secret=b"...", environ=os.environ)
    print(describe_plan(plan))        # what --dry-run shows, with the secret masked
    Supervisor(plan).run()            # launch/supervisor.py starts exactly this

Arguments + free ports (+ what the other machines published at the rendezvous) → a ``LaunchPlan`` of
``TaskLaunch(task, argv, env, log_path)``. Nothing here starts a process or opens a socket, so every
environment can be compared by equality and printed by ``--dry-run``. Rank 0 runs on node 0; every
task gets the caller's environment minus the launcher's own variables, plus its cluster identity,
conveyor's and torchrun's variables (docs/launcher.md, "Settings from the launcher to the task"), and with
``tf_flags=True`` TensorFlow 1's cluster flags; with ``bind`` each task's CPUs (``launch/binding.py``).
Placement and every variable: ``docs/launcher.md``, "The plan".
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from conveyor.cluster import ClusterSpec, TaskId, join_address, split_address, task_environment, validate
from conveyor.cluster.settings import JobSettings, owned_variables
from conveyor.cluster.spec import DATA_JOBS
from conveyor.cluster.strategy_name import NAMES as STRATEGY_NAMES
from conveyor.cluster.strategy_name import StrategyName, default_strategy, parse_strategy
from conveyor.cluster.variables import (  # re-exported: conveyor.launch.*_VAR and the supervisor use them
    DATA_SERVICE_VAR,
    JOB_SECRET_VAR,
    OMP_DEFAULT_VAR,
    REJOIN_VAR,
    RESTART_COUNT_VAR,
    RESUME_VAR,
    ROUND_VAR,
    TASK_INDEX_VAR,
    TASK_TYPE_VAR,
    TIMEOUT_VAR,
    TTY_VAR,
)
from conveyor.launch.binding import BIND_MODES, CpuTopology, TaskCpus, bind_cpus, format_cpus

__all__ = [
    "OWNED_VARS",
    "REJOIN_VAR",
    "RESTART_COUNT_VAR",
    "OMP_DEFAULT_VAR",
    "RESUME_VAR",
    "STRATEGIES",
    "TORCHRUN_VARS",
    "TIMEOUT_VAR",
    "TTY_VAR",
    "LaunchPlan",
    "NodeInfo",
    "RunOptions",
    "TaskLaunch",
    "build_plan",
    "cluster_from_nodes",
    "describe_plan",
    "job_strategy",
    "local_plan",
    "max_tasks_per_node",
    "resolve_strategy",
]

TORCHRUN_RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"
#: Every variable torchrun's agent sets on a worker (torch 2.x ``LocalElasticAgent._start_workers``),
#: which the launcher sets on training tasks with the same meaning.
TORCHRUN_VARS: tuple[str, ...] = (
    "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", TORCHRUN_RESTART_VAR,
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)

#: The strategy names `--strategy` accepts (``ps-ssp:K`` with a staleness bound K >= 0).
STRATEGIES: tuple[str, ...] = STRATEGY_NAMES

#: The dispatcher's figures (per data worker rates, queues, the trainers' input wait), in the job's logs folder
DATA_REPORT = "data_service.json"
#: How many times a data worker that exits is started again (per attempt of the job; k8s: per pod)
DATA_WORKER_RESTARTS = 3

#: Open files the launcher holds per task: the task's output pipe and its log for the whole job, and a
#: socket for a moment while free ports are picked (all at once, so the kernel hands out distinct ones).
FILES_PER_TASK = 3
#: Open files the launcher keeps for itself (stdio, the interpreter's own, torch and the rendezvous store).
_FILES_RESERVED = 64

#: Variables the launcher sets on some or all tasks; removed from the inherited environment first, so
#: that only the launcher's own values (or none) reach a task.
#: TORCH_NCCL_ASYNC_ERROR_HANDLING is not among them: the caller's value is passed on, as torchrun does.
OWNED_VARS: tuple[str, ...] = (
    "TF_CONFIG", *(v for v in TORCHRUN_VARS if v != "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    TASK_TYPE_VAR, TASK_INDEX_VAR, JOB_SECRET_VAR, OMP_DEFAULT_VAR, ROUND_VAR, DATA_SERVICE_VAR, REJOIN_VAR,
    *owned_variables(),
)


@dataclass(frozen=True, kw_only=True)
class RunOptions(JobSettings):
    """`conveyor run`'s options for this machine: the job's settings (:class:`JobSettings`: strategy, timeout,
    pipeline, ...) and the launcher's own, checked once (errors name the flag).

    ``workers`` counts training tasks (``worker:0..N-1``; with ``chief=True`` the first is ``chief:0``
    instead); either way rank 0 is the chief that writes checkpoints. ``data_dir``/``output_dir`` must be
    absolute: every task gets the same folders whatever its working directory. ``strategy=None`` picks
    the default for the job's shape (see :func:`resolve_strategy`).
    """

    script: str
    data_dir: str
    output_dir: str
    script_args: tuple[str, ...] = ()
    workers: int = 1
    ps: int = 0
    restart_delay: float = 1.0
    python: str = sys.executable
    linger: float = 30.0
    bind: str = "none"  # --bind none|core|socket: each task's CPU affinity (launch/binding.py)
    data_workers: int = 0  # --data-workers K: data-service workers on this machine (docs/data-service.md)
    data_pipeline: str | None = None  # --data-pipeline MODULE:FUNCTION, what they run

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "script_args", tuple(self.script_args))
        if not isinstance(self.script, str) or not self.script:
            raise ValueError("SCRIPT is missing: give the training script to run, e.g. conveyor run -n 2 train.py")
        validate.count(self.ps, "--ps", 0, "parameter servers on this machine")
        # -n 0 is a machine of parameter servers only, one node of a job on several machines (cli/run.py
        # checks that); with no --ps it would start nothing at all.
        validate.count(self.workers, "--workers", 0 if self.ps or self.data_workers else 1,
                       "training processes on this machine; -n 0 only with --ps M or --data-workers K, for a node "
                       "of parameter servers or data workers")
        validate.seconds(self.restart_delay, "--restart-delay", zero_ok=True, most=3600.0,
                         example="e.g. --restart-delay 1, or 0: none")
        validate.seconds(self.linger, "--linger", zero_ok=True, most=3600.0,
                         example="e.g. --linger 30, or 0: stop them at once")
        validate.count(self.data_workers, "--data-workers", 0,
                       "data-service workers on this machine (0: none), each running --data-pipeline")
        if self.data_workers and not self.data_pipeline:
            raise ValueError(f"--data-workers {self.data_workers} needs --data-pipeline MODULE:FUNCTION: the function "
                             f"(no arguments) that returns the job's conveyor.data.Dataset, which every data worker "
                             f"imports and builds, e.g. --data-pipeline myjob.input:train_pipeline")
        _check_task_files(self.workers, self.ps + self.data_workers + (1 if self.data_workers else 0))
        self.check_job(self.workers)
        if self.bind not in BIND_MODES:
            raise ValueError(f"--bind {self.bind!r}: expected one of {', '.join(BIND_MODES)}")
        for flag, path in (("--data-dir", self.data_dir), ("--output-dir", self.output_dir)):
            if not isinstance(path, str) or not os.path.isabs(path):
                raise ValueError(f"{flag} {path!r} must be an absolute path here (the command line makes it "
                                 f"absolute from the current folder)")
        if not isinstance(self.python, str) or not self.python:
            raise ValueError("--python is empty; give an interpreter, e.g. --python /usr/bin/python3")

    @property
    def tasks_per_node(self) -> int:
        """This machine's tasks on one machine: training, ps, data workers and (with data workers) the dispatcher."""
        return self.workers + self.ps + self.data_workers + (1 if self.data_workers else 0)


@dataclass(frozen=True)
class NodeInfo:
    """One machine of the job as the rendezvous publishes it: its address and its tasks' ports.

    ``ports`` has one port per task, the ``workers`` training tasks first, then the ``ps`` servers, then the
    ``data_workers`` (the dispatcher's port is the job's: :func:`build_plan`'s ``dispatcher_port``).
    """

    host: str
    workers: int
    ps: int
    ports: tuple[int, ...]
    data_workers: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ports", tuple(self.ports))
        if len(self.ports) != self.workers + self.ps + self.data_workers:
            raise ValueError(f"node {self.host} has {len(self.ports)} ports for {self.workers} workers + {self.ps} "
                             f"ps + {self.data_workers} data workers; expected one per task")


@dataclass(frozen=True)
class TaskLaunch:
    """One process to start: the task it is, its command, its whole environment, its log file.

    ``set_vars`` names the variables the launcher set (in ``env`` order after the inherited ones): what
    ``--dry-run`` shows, since the rest is the caller's own environment. ``cpus``: the CPUs the task is
    bound to (``--bind``), empty when it is not bound.
    """

    task: TaskId
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    log_path: str
    set_vars: tuple[str, ...] = ()
    cpus: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return str(self.task)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything this machine's launcher starts, and the cluster it belongs to."""

    spec: ClusterSpec
    strategy: str
    tasks: tuple[TaskLaunch, ...]
    log_dir: str
    node_rank: int = 0
    nnodes: int = 1
    inherited: int = 0  # how many variables come from the caller's environment (for --dry-run)

    @property
    def checkpoint_dir(self) -> str:
        """Where the chief writes checkpoints (``<output>/checkpoints``): the supervisor's sign of progress."""
        return os.path.join(os.path.dirname(self.log_dir), "checkpoints")


def max_tasks_per_node() -> tuple[int, int, int]:
    """``(tasks, soft, hard)``: how many tasks one launcher can hold under this process's open-file limit
    (``ulimit -n``: ``soft``, raisable up to ``hard``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20, soft, hard
    return max(0, (soft - _FILES_RESERVED) // FILES_PER_TASK), soft, hard


def resolve_strategy(strategy: StrategyName | str | None, world_size: int, num_ps: int) -> str:
    """The strategy name to run, in its canonical spelling: see :func:`job_strategy`."""
    return job_strategy(strategy, world_size, num_ps).name


def job_strategy(strategy: StrategyName | str | None, world_size: int, num_ps: int) -> StrategyName:
    """The strategy to run: the one given (parsed already by :class:`JobSettings`), checked against the job's
    shape, or the default (``conveyor.cluster.default_strategy``, which ``conveyor.init()`` uses too).
    """
    if strategy is None:
        return parse_strategy(default_strategy(world_size, num_ps))
    parsed = parse_strategy(strategy, what="--strategy")
    if parsed.uses_ps and not num_ps:
        raise ValueError(f"--strategy {parsed.name} needs parameter servers: add --ps M (e.g. --ps 1)")
    if num_ps and not parsed.uses_ps:
        raise ValueError(f"--ps {num_ps} starts parameter servers, which only the ps strategies use: add "
                         f"--strategy ps-sync, ps-async or ps-ssp:K, or drop --ps")
    if not parsed.distributed and world_size > 1:
        raise ValueError(f"--strategy local trains one process alone, but the job has {world_size} training "
                         f"processes: use --strategy allreduce, or -n 1")
    return parsed


def cluster_from_nodes(nodes: Sequence[NodeInfo], chief: bool = False,
                       dispatcher_port: int | None = None) -> ClusterSpec:
    """The job's cluster: every node's training tasks in node-rank order, then every node's ps; with data workers
    on any node, the dispatcher on node 0 (at ``dispatcher_port``) and the data workers in node-rank order.

    One node gives what ``conveyor.cluster.local_cluster`` gives for the same ports.
    """
    training = [join_address(n.host, p) for n in nodes for p in n.ports[:n.workers]]
    ps = [join_address(n.host, p) for n in nodes for p in n.ports[n.workers:n.workers + n.ps]]
    data = [join_address(n.host, p) for n in nodes for p in n.ports[n.workers + n.ps:]]
    if data and dispatcher_port is None:
        raise ValueError("data workers need a dispatcher: give cluster_from_nodes the dispatcher's port")
    dispatcher = (join_address(nodes[0].host, dispatcher_port),) if data else ()
    n_chief = 1 if chief else 0
    return ClusterSpec(chief=tuple(training[:n_chief]), worker=tuple(training[n_chief:]), ps=tuple(ps),
                       dispatcher=dispatcher, data_worker=tuple(data))


def build_plan(
    options: RunOptions,
    nodes: Sequence[NodeInfo],
    node_rank: int,
    *,
    master_addr: str,
    master_port: int,
    secret: bytes,
    environ: Mapping[str, str],
    topology: CpuTopology | None = None,
    membership_round: int | None = None,
    dispatcher_port: int | None = None,
) -> LaunchPlan:
    """The plan for node ``node_rank`` of ``nodes`` (all of them, in node-rank order).

    ``master_addr:master_port`` is where rank 0 (node 0's first training task) hosts torch's store;
    ``environ`` is the caller's environment, which every task inherits. ``topology``: this machine's CPUs
    for ``options.bind`` (read from sysfs and the launcher's affinity when not given). ``dispatcher_port``:
    where node 0 runs the data service's dispatcher when any node has data workers (:func:`data_task_argv`).
    ``membership_round``: an elastic job's round (``CONVEYOR_ROUND``).
    """
    _check_nodes(nodes, node_rank)
    spec = cluster_from_nodes(nodes, options.chief, dispatcher_port)
    settings = options.replace(strategy=job_strategy(options.strategy, spec.world_size, len(spec.ps)))
    strategy = settings.strategy.name  # what every task is told, the strategy resolved
    base = {k: v for k, v in environ.items() if k not in OWNED_VARS}
    node = nodes[node_rank]
    extra, torchrun = _node_env(options, node, node_rank, len(nodes), secret, environ, membership_round)
    if spec.dispatcher:
        extra[DATA_SERVICE_VAR] = spec.dispatcher[0]  # every task may `distribute(from_env())`
    log_dir = os.path.join(options.output_dir, "logs")
    mine = _node_tasks(spec, nodes, node_rank)
    places = _placements(options, len(mine), topology)
    launches = []
    for (task, local_rank), place in zip(mine, places, strict=True):
        own = task_environment(
            spec, task, secret=secret, data_dir=options.data_dir, output_dir=options.output_dir,
            master_addr=master_addr, master_port=master_port, strategy=strategy,
            local_rank=local_rank, local_world_size=node.workers,
        )
        if task.is_training:
            own.update(torchrun, ROLE_RANK=own["RANK"], ROLE_WORLD_SIZE=own["WORLD_SIZE"])
        own.update(settings.environ(training=task.is_training))
        own.update(extra)
        if place is not None and not environ.get("OMP_NUM_THREADS"):
            own["OMP_NUM_THREADS"] = str(place.threads)  # the user's own value wins, as without --bind
        flags = tf_flags(spec, task) if options.tf_flags else ()
        argv = (options.python, options.script, *flags, *options.script_args)
        if task.type in DATA_JOBS:
            argv = data_task_argv(options, spec, task, log_dir)
            own["PYTHONPATH"] = os.pathsep.join(p for p in (_script_dir(options), environ.get("PYTHONPATH")) if p)
        launches.append(TaskLaunch(
            task=task, argv=argv, env={**base, **own},
            log_path=os.path.join(log_dir, f"{task.type}-{task.index}.log"), set_vars=tuple(own),
            cpus=place.cpus if place is not None else (),
        ))
    return LaunchPlan(spec=spec, strategy=strategy, tasks=tuple(launches), log_dir=log_dir, node_rank=node_rank,
                      nnodes=len(nodes), inherited=len(base))


def _check_nodes(nodes: Sequence[NodeInfo], node_rank: int) -> None:
    if not nodes:
        raise ValueError("nodes is empty; a job has at least this machine")
    if not 0 <= node_rank < len(nodes):
        raise ValueError(f"--node-rank {node_rank} is out of range for --nnodes {len(nodes)} (0..{len(nodes) - 1})")
    if not nodes[0].workers:
        raise ValueError("node 0 runs rank 0, the chief, which hosts the process group's store and writes the "
                         "checkpoints: give node 0 -n 1 or more, and the parameter-server-only node (-n 0) another "
                         "--node-rank")


def _node_tasks(spec: ClusterSpec, nodes: Sequence[NodeInfo], node_rank: int) -> list[tuple[TaskId, int]]:
    """Node ``node_rank``'s tasks with their local ranks: its training tasks, its ps, the dispatcher (node 0, when
    the job has data workers), its data workers."""
    node, before = nodes[node_rank], nodes[:node_rank]
    first_rank, first_ps = sum(n.workers for n in before), sum(n.ps for n in before)
    mine = [(spec.training_tasks[first_rank + i], i) for i in range(node.workers)]
    mine += [(TaskId("ps", first_ps + i), 0) for i in range(node.ps)]
    if spec.dispatcher and node_rank == 0:
        mine.append((TaskId("dispatcher", 0), 0))
    first_data = sum(n.data_workers for n in before)
    return mine + [(TaskId("data_worker", first_data + i), 0) for i in range(node.data_workers)]


def data_task_argv(options: RunOptions, spec: ClusterSpec, task: TaskId, log_dir: str) -> tuple[str, ...]:
    """A data-service task's command: `conveyor data serve|worker`, listening where the cluster says, signed with
    the job secret its environment holds. The dispatcher writes its figures to ``logs/data_service.json``."""
    host, port = split_address(spec.task_address(task.type, task.index))
    where = ("--host", host, "--port", str(port))
    if task.type == "dispatcher":
        return (options.python, "-m", "conveyor", "data", "serve", *where, "--report",
                os.path.join(log_dir, DATA_REPORT))
    return (options.python, "-m", "conveyor", "data", "worker", "--dispatcher", spec.dispatcher[0], *where,
            "--pipeline", str(options.data_pipeline))


def _script_dir(options: RunOptions) -> str:
    """The training script's folder: where a data worker looks for --data-pipeline's module (and the cwd)."""
    return os.path.dirname(os.path.abspath(options.script))


def _placements(options: RunOptions, tasks: int,
                topology: CpuTopology | None) -> list[TaskCpus | None]:
    """Each task's CPUs under ``options.bind``, in task order; None for every task when unbound."""
    if options.bind == "none":
        return [None] * tasks
    places = bind_cpus(topology if topology is not None else CpuTopology.read(), tasks, options.bind)
    return list(places or [None] * tasks)


def _node_env(options: RunOptions, node: NodeInfo, node_rank: int, nnodes: int, secret: bytes,
              environ: Mapping[str, str], membership_round: int | None) -> tuple[dict[str, str], dict[str, str]]:
    """The variables every task of this node gets besides the settings', and those torchrun gives its
    training tasks."""
    extra = {"PYTHONUNBUFFERED": "1"}  # lines reach the launcher (and the log) as they are printed
    if membership_round is not None:
        extra[ROUND_VAR] = str(membership_round)
    if node.workers + node.ps > 1 and not environ.get("OMP_NUM_THREADS") and options.bind == "none":
        # torchrun's default: N processes with a full-size OpenMP pool each would overload the cores
        # (a bound task gets its own cores' count instead, in build_plan).
        extra.update({"OMP_NUM_THREADS": "1", OMP_DEFAULT_VAR: "1"})
    torchrun = {
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_NAME": "default",
        TORCHRUN_RESTART_VAR: "0",
        "TORCHELASTIC_MAX_RESTARTS": str(options.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id(secret),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    return extra, torchrun


def run_id(secret: bytes) -> str:
    """``TORCHELASTIC_RUN_ID``: the same on every node of a job (they share the secret) and different for
    each job started with a fresh secret. A one-way hash, so the id reveals nothing of the secret."""
    return hashlib.sha256(b"conveyor run id\0" + secret).hexdigest()[:16]


def tf_flags(spec: ClusterSpec, task: TaskId) -> tuple[str, ...]:
    """TensorFlow 1's cluster flags for ``task``, ``--flag=value`` each (an empty ``--ps_hosts=`` parses
    as the empty string, where a separate empty argument would not survive some flag parsers)."""
    return (f"--ps_hosts={','.join(spec.ps)}", f"--worker_hosts={','.join(spec.worker)}",
            f"--job_name={task.type}", f"--task_index={task.index}")


def local_plan(
    options: RunOptions,
    ports: Sequence[int],
    *,
    master_port: int,
    secret: bytes,
    environ: Mapping[str, str],
    host: str = "127.0.0.1",
    topology: CpuTopology | None = None,
) -> LaunchPlan:
    """The plan for a job on this machine only: one port per task (training tasks first, then ps, then the data
    workers and, with data workers, the dispatcher's last)."""
    data = options.data_workers
    node = NodeInfo(host, options.workers, options.ps, tuple(ports[:len(ports) - (1 if data else 0)]), data)
    return build_plan(options, [node], 0, master_addr=host, master_port=master_port, secret=secret,
                      environ=environ, topology=topology, dispatcher_port=ports[-1] if data else None)


def describe_plan(plan: LaunchPlan) -> str:
    """What ``conveyor run --dry-run`` prints: every task's command and the variables the launcher sets.

    The job secret is masked: a dry run's output ends up in terminals, CI logs and bug reports.
    """
    spec = plan.spec
    where = f"node {plan.node_rank} of {plan.nnodes}" if plan.nnodes > 1 else "this machine"
    lines = [
        f"{len(plan.tasks)} task(s) on {where}; world size {spec.world_size}, strategy {plan.strategy}, "
        f"logs in {plan.log_dir}",
        f"cluster: {json.dumps(spec.as_dict())}",
        f"each task inherits the caller's environment ({plan.inherited} variables) and gets these:",
    ]
    for launch in plan.tasks:
        lines.append("")
        lines.append(f"[{launch.name}] {shlex.join(launch.argv)}")
        lines.append(f"    log: {launch.log_path}")
        if launch.cpus:
            lines.append(f"    cpus: {format_cpus(launch.cpus)} ({len(launch.cpus)} logical)")
        for name in launch.set_vars:
            value = launch.env[name]
            shown = f"<masked: {len(value)} hex digits>" if name == JOB_SECRET_VAR else shlex.quote(value)
            lines.append(f"    {name}={shown}")
    return "\n".join(lines)


def _check_task_files(workers: int, ps: int) -> None:
    limit, soft, hard = max_tasks_per_node()
    tasks = workers + ps
    if tasks <= limit:
        return
    need = tasks * FILES_PER_TASK + _FILES_RESERVED
    above = "" if hard == resource.RLIM_INFINITY or need <= hard else f" (above the hard limit {hard}: as root)"
    raise ValueError(f"-n {workers} --ps {ps}: {tasks} tasks, but this machine's open-file limit ({soft}) lets one "
                     f"launcher run at most {limit} (each task needs {FILES_PER_TASK} open files); raise it with "
                     f"`ulimit -n {need}`{above}, or run fewer tasks per machine (more machines: --nnodes)")

