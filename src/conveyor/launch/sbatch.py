"""The sbatch script for a conveyor job on Slurm: pure text from a :class:`SbatchJob`, checked first.

    job = SbatchJob(script="train.py", nodes=2, workers=4, data_dir="/shared/data", output_dir="/shared/out",
                    workdir="/shared/project", python="/shared/venv/bin/python")
    print(sbatch_script(job))          # what `conveyor slurm` prints, writes or submits

The script asks for whole nodes (or ``cpus_per_node``), writes a fresh job secret into the shared working
folder (mode 600, created exclusively in a private folder from ``mktemp -d``, removed when the script ends)
and runs one launcher per node with ``srun --ntasks-per-node=1``; each launcher derives its node rank, the
node count and the rendezvous host from Slurm (:mod:`conveyor.launch.slurm`). Parameter servers go beside
the workers, one more per node from node 0 until all are placed, or on nodes of their own, the last ones
(``ps_nodes``; ``conveyor run -n 0`` there); when nodes differ, a ``case`` on ``$SLURM_NODEID`` -
single-quoted, so each node's own shell expands it - picks the node's ``-n``/``--ps``. Every value from
the user is shell-quoted; values that go on ``#SBATCH`` lines are refused if they hold spaces or quotes.
``data_nodes`` D: the last D nodes run ``data_workers`` data workers each (``-n 0 --data-workers K``); the
dispatcher runs on node 0 (conveyor run's rendezvous places it). When they need other resources than the
training nodes (GPUs there, ``data_partition`` or ``data_cpus_per_node``), the job is heterogeneous: two
``#SBATCH hetjob`` components and one step over both (``srun OPTIONS0 COMMAND0 : OPTIONS1 COMMAND1``).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

from conveyor.cluster.settings import JobSettings

__all__ = ["SbatchJob", "node_layout", "sbatch_script"]

_TIME_RE = re.compile(r"[0-9]+(-[0-9]+)?(:[0-9]+){0,2}")  # minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM[:SS]
_WORD_RE = re.compile(r"[A-Za-z0-9_.,:+=@%/\-]+")  # what a #SBATCH value may hold: no spaces or quotes


@dataclass(frozen=True, kw_only=True)
class SbatchJob(JobSettings):
    """One conveyor job on Slurm: the job's settings (:class:`JobSettings`, passed on to each node's
    `conveyor run` as its flags) and the script's own. ``workers`` and the GPUs are per node; ``ps`` counts
    the whole job's parameter servers. Paths are used as given: make them absolute (``conveyor slurm`` does)."""

    script: str
    data_dir: str
    output_dir: str
    workdir: str
    python: str
    script_args: tuple[str, ...] = ()
    nodes: int = 1
    workers: int = 1
    gpus_per_node: int | None = None
    ps: int = 0
    ps_nodes: int = 0  # nodes of parameter servers only, the last ones; 0: the ps tasks go beside the workers
    data_nodes: int = 0  # nodes of data-service workers only, the very last ones (`conveyor run -n 0 --data-workers`)
    data_workers: int = 0  # data workers on each of them
    data_pipeline: str | None = None  # what they run, MODULE:FUNCTION
    data_partition: str | None = None  # the data nodes' partition (a heterogeneous job); default: ``partition``
    data_cpus_per_node: int | None = None  # the data nodes' CPUs (a heterogeneous job); default: whole nodes
    job_name: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    cpus_per_node: int | None = None
    run_args: tuple[str, ...] = ()  # more `conveyor run` flags, e.g. ("--max-restarts", "5")
    sbatch_args: tuple[str, ...] = ()  # more #SBATCH options, e.g. ("--mem=0",)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "script_args", tuple(self.script_args))
        object.__setattr__(self, "run_args", tuple(self.run_args))
        object.__setattr__(self, "sbatch_args", tuple(self.sbatch_args))
        counts = (("--nodes", self.nodes, 1), ("-n", self.workers, 1), ("--ps", self.ps, 0),
                  ("--ps-nodes", self.ps_nodes, 0), ("--gpus-per-node", self.gpus_per_node, 1),
                  ("--cpus-per-node", self.cpus_per_node, 1), ("--data-nodes", self.data_nodes, 0),
                  ("--data-workers", self.data_workers, 0), ("--data-cpus-per-node", self.data_cpus_per_node, 1))
        for flag, value, low in counts:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{flag} {value!r}: expected a whole number >= {low}")
        self._check_data_nodes()
        if self.ps_nodes and self.ps_nodes >= self.nodes - self.data_nodes:
            raise ValueError(f"--ps-nodes {self.ps_nodes} of --nodes {self.nodes}: node 0 runs rank 0, the chief; "
                             f"leave at least one node for the workers")
        if self.ps_nodes > self.ps:
            raise ValueError(f"--ps-nodes {self.ps_nodes} with --ps {self.ps}: each node of parameter servers runs one "
                             f"at least")
        if self.gpus_per_node is not None and self.workers > self.gpus_per_node:
            raise ValueError(f"-n {self.workers} with --gpus-per-node {self.gpus_per_node}: two training processes "
                             f"would share a GPU; one process per GPU is -n {self.gpus_per_node}")
        self.check_job(self.workers)
        if self.time is not None and not _TIME_RE.fullmatch(self.time):
            raise ValueError(f"--time {self.time!r}: expected Slurm's form, e.g. 90 (minutes), 1:30:00 or 2-00:00:00")
        for flag, value in (("--job-name", self.job_name), ("--partition", self.partition),
                            ("--data-partition", self.data_partition), ("--account", self.account),
                            *(("--sbatch-option", a) for a in self.sbatch_args)):
            if value is not None and not _WORD_RE.fullmatch(value):
                raise ValueError(f"{flag} {value!r}: an #SBATCH value may hold letters, digits and _.,:+=@%/- only")
        if not self.script:
            raise ValueError("SCRIPT is missing: give the training script every node runs")

    def _check_data_nodes(self) -> None:
        if not self.data_nodes and (self.data_partition is not None or self.data_cpus_per_node is not None):
            raise ValueError("--data-partition and --data-cpus-per-node describe the data nodes: add --data-nodes D "
                             "--data-workers K --data-pipeline MODULE:FUNCTION, or drop them")
        if not (self.data_nodes or self.data_workers or self.data_pipeline):
            return
        if not (self.data_nodes and self.data_workers and self.data_pipeline):
            raise ValueError("--data-nodes D, --data-workers K and --data-pipeline MODULE:FUNCTION go together: the "
                             "last D nodes run K data workers each, building the pipeline that function returns")
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.data_pipeline):
            raise ValueError(f"--data-pipeline {self.data_pipeline!r}: expected MODULE:FUNCTION, e.g. job.input:train")
        if self.data_nodes >= self.nodes:
            raise ValueError(f"--data-nodes {self.data_nodes} of --nodes {self.nodes}: node 0 runs rank 0, the chief; "
                             f"leave at least one node for the workers")
        if self.heterogeneous and ":" in (*self.script_args, *self.run_args):
            raise ValueError("a bare ':' among the script's arguments or --run-option: in a heterogeneous job's srun "
                             "line it would separate the components; quote it differently (e.g. --flag=:)")

    @property
    def heterogeneous(self) -> bool:
        """Whether the data nodes are a component of their own: they need other resources than the training nodes
        (those hold GPUs, or the data nodes have a partition or CPU count of their own)."""
        return bool(self.data_nodes) and (self.gpus_per_node is not None or self.data_partition is not None
                                          or self.data_cpus_per_node is not None)

    @property
    def name(self) -> str:
        return self.job_name or re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.splitext(os.path.basename(self.script))[0])


def node_layout(job: SbatchJob) -> list[tuple[int, int]]:
    """``(workers, ps)`` per node. Without ``ps_nodes`` every node runs ``job.workers`` and the ps tasks go one
    per node from node 0, round and round (the first nodes carry one more when they do not divide evenly);
    with it, the last ``ps_nodes`` nodes run the ps tasks alone (``-n 0``), spread the same way."""
    nodes = job.nodes - job.data_nodes
    data = [(0, 0)] * job.data_nodes  # the data nodes, last: data workers only (_tasks_flags)
    workers = nodes - job.ps_nodes
    if not job.ps_nodes:
        return [(job.workers, _share(job.ps, nodes, i)) for i in range(nodes)] + data
    return [(job.workers, 0)] * workers + [(0, _share(job.ps, job.ps_nodes, i)) for i in range(job.ps_nodes)] + data


def _share(total: int, parts: int, i: int) -> int:
    return total // parts + (1 if i < total % parts else 0)


def _groups(layout: list[tuple[int, int]]) -> list[tuple[int, int, tuple[int, int]]]:
    """Runs of consecutive nodes with the same tasks: ``(first, last, (workers, ps))``."""
    groups: list[tuple[int, int, tuple[int, int]]] = []
    for i, tasks in enumerate(layout):
        if groups and groups[-1][2] == tasks:
            groups[-1] = (groups[-1][0], i, tasks)
        else:
            groups.append((i, i, tasks))
    return groups


def _tasks_flags(tasks: tuple[int, int], job: SbatchJob) -> str:
    workers, ps = tasks
    if tasks == (0, 0):  # a data node (node_layout)
        return f"-n 0 --data-workers {job.data_workers} --data-pipeline {job.data_pipeline}"
    return f"-n {workers}" + (f" --ps {ps}" if ps else "")


def _describe(tasks: tuple[int, int], job: SbatchJob) -> str:
    workers, ps = tasks
    if tasks == (0, 0):
        return f"{job.data_workers} data worker{'s' if job.data_workers != 1 else ''}"
    text = [f"{workers} worker{'s' if workers != 1 else ''}"] if workers else []
    return " + ".join(text + ([f"{ps} ps"] if ps else []))


def _nodes_text(first: int, last: int) -> str:
    return f"node {first}" if first == last else f"nodes {first}-{last}"


def _header(job: SbatchJob, groups: list) -> list[str]:
    layout = "; ".join(f"{_nodes_text(a, b)}: {_describe(t, job)}" for a, b, t in groups)
    het = job.heterogeneous
    lines = [
        "#!/bin/bash",
        f"# conveyor job {job.name}: {job.script} on {job.nodes} node{'s' if job.nodes != 1 else ''} ({layout}).",
        "# Written by `conveyor slurm`; submit with `sbatch THIS_FILE`. Every node must see this working folder,",
        "# the data folder and the output folder (a shared file system); the job secret is written here.",
        *(["# A heterogeneous job: the training nodes, then (after `hetjob`) the data nodes with their own resources."]
          if het else []),
        f"#SBATCH --job-name={job.name}",
        *_resources(job.nodes - job.data_nodes if het else job.nodes, job.cpus_per_node, job.gpus_per_node,
                    job.partition, job),
        *(f"#SBATCH {arg}" for arg in job.sbatch_args),
    ]
    if het:
        lines += ["#SBATCH hetjob", *_resources(job.data_nodes, job.data_cpus_per_node, None,
                                                 job.data_partition or job.partition, job)]
    return lines


def _resources(nodes: int, cpus: int | None, gpus: int | None, partition: str | None, job: SbatchJob) -> list[str]:
    """One component's #SBATCH lines (the whole job's when it is not heterogeneous)."""
    lines = [f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
             "#SBATCH --exclusive" if cpus is None else f"#SBATCH --cpus-per-task={cpus}"]
    if gpus is not None:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    for option, value in (("time", job.time), ("partition", partition), ("account", job.account)):
        if value is not None:
            lines.append(f"#SBATCH --{option}={value}")
    return lines


def _srun(job: SbatchJob) -> list[str]:
    """The srun line: one step, over both components of a heterogeneous job (`srun A : B`, Slurm numbering the
    training nodes first), each node's launcher given its tasks (a `case` on $SLURM_NODEID where nodes differ)."""
    # the job's settings as every node's `conveyor run` flags: --strategy NAME, --stages S, --chief, ...
    common = [shlex.join(flag) for flag in job.flags("run")]
    common += [f"--data-dir {shlex.quote(job.data_dir)}", '--output-dir "$OUTPUT"', '--job-secret-file "$SECRET"']
    if job.run_args:
        common.append(shlex.join(job.run_args))
    common.append(shlex.join([job.script, *job.script_args]))
    layout = node_layout(job)
    cpus = '"$SLURM_CPUS_ON_NODE"' if job.cpus_per_node is None else str(job.cpus_per_node)
    srun = f"srun {_srun_options(cpus, job.gpus_per_node)}"
    if not job.heterogeneous:
        return _command(srun, layout, job, common)
    training = _command(srun, layout[:-job.data_nodes], job, common)
    data_cpus = '"$DATA_CPUS"' if job.data_cpus_per_node is None else str(job.data_cpus_per_node)
    training[-1] += " : \\"
    return training + _command(f"  {_srun_options(data_cpus, None)}", layout[-job.data_nodes:], job, common)


def _srun_options(cpus: str, gpus: int | None) -> str:
    return f"--ntasks-per-node=1 --cpus-per-task={cpus} --kill-on-bad-exit=1" + (
        f" --gpus-per-node={gpus}" if gpus is not None else "")


def _command(srun: str, layout: list[tuple[int, int]], job: SbatchJob, common: list[str]) -> list[str]:
    """``srun`` (or a component's options) and the launcher's command for the nodes of ``layout``."""
    groups = _groups(layout)
    if len(groups) == 1:
        head = [f'{srun} "$PYTHON" -m conveyor run {_tasks_flags(groups[0][2], job)}']
    else:  # no backslash inside the single quotes: the inner shell would join the lines
        head = [f"{srun} bash -c '", '  case "$SLURM_NODEID" in']
        for first, last, tasks in groups[:-1]:
            pattern = "|".join(str(i) for i in range(first, last + 1))
            head.append(f'    {pattern}) tasks="{_tasks_flags(tasks, job)}" ;;')
        head.append(f'    *) tasks="{_tasks_flags(groups[-1][2], job)}" ;;')
        head += ["  esac", """  exec "$0" -m conveyor run $tasks "$@"' "$PYTHON\""""]
    head[-1] += " \\"
    return head + [f"  {part} \\" for part in common[:-1]] + [f"  {common[-1]}"]


_DATA_CPUS = [
    "# The data nodes are whole nodes; srun gives each the same --cpus-per-task: the fewest any of them has.",
    'DATA_CPUS="$(echo "$SLURM_JOB_CPUS_PER_NODE_HET_GROUP_1" | tr , "\\n" | sed "s/(.*//" | sort -n | head -1)"',
]


def sbatch_script(job: SbatchJob) -> str:
    """The whole sbatch script for ``job`` (see the module docstring)."""
    lines = _header(job, _groups(node_layout(job))) + [
        "set -euo pipefail",
        "",
        f"cd {shlex.quote(job.workdir)}",
        f"PYTHON={shlex.quote(job.python)}",
        f"OUTPUT={shlex.quote(job.output_dir)}",
        'mkdir -p "$OUTPUT"',
        "# The job secret signs the launchers' and parameter servers' messages: a fresh one per job, readable by",
        "# you only, in the shared working folder where every node's launcher reads it. mktemp makes a folder",
        "# of yours alone (mode 700, a random name) and noclobber creates the file exclusively: nothing another",
        "# user made beforehand in this folder is written into.",
        'SECRET_DIR="$(mktemp -d "$PWD/.conveyor-job-$SLURM_JOB_ID.XXXXXXXX")"',
        "trap 'rm -rf \"$SECRET_DIR\"' EXIT",
        'SECRET="$SECRET_DIR/secret"',
        "(umask 077 && set -o noclobber && od -An -tx1 -N32 /dev/urandom | tr -d ' \\n' > \"$SECRET\")",
        "",
        *(_DATA_CPUS if job.heterogeneous and job.data_cpus_per_node is None else []),
        "# One launcher per node. Each reads its node rank, the node count and the rendezvous host (the first",
        "# node) from Slurm: no --nnodes, --node-rank or --rdzv to get wrong.",
        *_srun(job),
    ]
    return "\n".join(lines) + "\n"
