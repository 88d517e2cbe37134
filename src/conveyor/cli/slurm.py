"""`conveyor slurm`: the sbatch script for a job, printed, written or submitted.

    conveyor slurm --nodes 2 -n 4 train.py --epochs 5                      # print the script
    conveyor slurm --nodes 4 --gpus-per-node 8 --time 2:00:00 -o job.sbatch train.py
    conveyor slurm --nodes 2 -n 2 --ps 2 --strategy ps-sync --submit train.py   # sbatch it; prints the job id
    conveyor slurm --nodes 5 --gpus-per-node 8 --data-nodes 1 --data-workers 32 --data-pipeline job.input:train \
        --partition gpu --data-partition cpu train.py      # a heterogeneous job: 4 GPU nodes + 1 CPU data node

This module only parses arguments and runs sbatch; the script is `conveyor.launch.sbatch`, and what
each node's launcher reads from Slurm is `conveyor.launch.slurm`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys

from conveyor.cli import Command, CommandError
from conveyor.cluster.settings import add_arguments as add_settings
from conveyor.cluster.settings import given as given_settings
from conveyor.data.service.pipelines import check_pipeline
from conveyor.data.service.protocol import DataServiceError
from conveyor.fileio import atomic_write
from conveyor.launch.sbatch import SbatchJob, sbatch_script

SUBMIT_TIMEOUT = 60.0

EXAMPLES = """\
examples:
  conveyor slurm --nodes 2 -n 4 train.py --epochs 5
  conveyor slurm --nodes 4 --gpus-per-node 8 --time 2:00:00 --partition gpu -o job.sbatch train.py
  conveyor slurm --nodes 2 -n 2 --ps 2 --strategy ps-sync --submit train.py
  conveyor slurm --nodes 3 -n 2 --ps 2 --ps-nodes 1 --strategy ps-async train.py   # ps tasks on node 2
  conveyor slurm --nodes 3 --gpus-per-node 4 --data-nodes 1 --data-workers 16 --data-pipeline job.input:train \
      --partition gpu --data-partition cpu train.py    # 2 GPU nodes train, a CPU node runs the data workers

The script runs `srun --ntasks-per-node=1 python -m conveyor run -n N ... SCRIPT ARGS` on every node:
each launcher reads its node rank, the node count and the rendezvous host (the first node) from Slurm.
This folder (the script's), the data folder and the output folder must be on a file system every node
sees; the script writes a fresh job secret (mode 600) here and removes it when the job ends. Parameter
servers go beside the workers, one more per node from node 0 until all are placed, or with --ps-nodes P
alone on the last P nodes. With --data-nodes D the last D nodes run data workers only and node 0 the
dispatcher; when they need other resources (GPUs on the training nodes, --data-partition,
--data-cpus-per-node) the job is heterogeneous: the data nodes are a component of their own (hetjob).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    job = parser.add_argument_group("the job")
    job.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes (default 1)")
    job.add_argument("-n", "--workers", type=int, default=None, metavar="N",
                     help="training processes per node (default: --gpus-per-node, else 1)")
    job.add_argument("--gpus-per-node", type=int, default=None, metavar="G", help="GPUs per node: one process each")
    job.add_argument("--ps", type=int, default=0, metavar="M",
                     help="parameter servers in the whole job (default 0): beside the workers, one more per node "
                     "from node 0, or on --ps-nodes of their own")
    job.add_argument("--ps-nodes", type=int, default=0, metavar="P",
                     help="run the ps tasks alone on the last P of the --nodes (conveyor run -n 0 there)")
    job.add_argument("--data-nodes", type=int, default=None, metavar="D",
                     help="run data-service workers alone on the last D of the --nodes (conveyor run -n 0 "
                     "--data-workers K there; node 0 runs the dispatcher); a heterogeneous job with "
                     "--gpus-per-node, --data-partition or --data-cpus-per-node, so the data nodes hold no GPUs")
    job.add_argument("--data-workers", type=int, default=0, metavar="K", help="data workers on each data node")
    job.add_argument("--data-pipeline", default=None, metavar="MODULE:FUNCTION",
                     help="the function returning the Dataset the data workers run (docs/data-service.md)")
    job.add_argument("--data-dir", default="data", metavar="D", help="the job's input folder, shared (default ./data)")
    job.add_argument("--output-dir", default="output", metavar="O",
                     help="checkpoints, logs, metrics, shared (default ./output)")
    job.add_argument("--python", default=sys.executable, metavar="PATH",
                     help="the interpreter with conveyor installed, the same path on every node (default: this one)")
    job.add_argument("--run-option", action="append", default=[], metavar="ARG",
                     help="one more `conveyor run` argument, e.g. --run-option=--max-restarts=5 (repeat)")
    settings = parser.add_argument_group("the job's settings, as `conveyor run` takes them (passed on to every node)")
    add_settings(dict(job=settings), "slurm")
    slurm = parser.add_argument_group("Slurm")
    slurm.add_argument("--time", default=None, metavar="T", help="time limit, e.g. 90 or 1:30:00")
    slurm.add_argument("--partition", default=None, metavar="P")
    slurm.add_argument("--account", default=None, metavar="A")
    slurm.add_argument("--job-name", default=None, metavar="NAME", help="default: the script's name")
    slurm.add_argument("--cpus-per-node", type=int, default=None, metavar="C",
                       help="CPUs for each node's launcher and its tasks (default: whole nodes, --exclusive)")
    slurm.add_argument("--data-partition", default=None, metavar="P",
                       help="the --data-nodes' partition, e.g. a CPU one (default: --partition; a heterogeneous job)")
    slurm.add_argument("--data-cpus-per-node", type=int, default=None, metavar="C",
                       help="CPUs for each data node's launcher and data workers (default: whole nodes; a "
                       "heterogeneous job)")
    slurm.add_argument("--sbatch-option", action="append", default=[], metavar="OPT",
                       help="one more #SBATCH line, e.g. --sbatch-option=--mem=0 (repeat; the training nodes' "
                       "component in a heterogeneous job)")
    out = parser.add_argument_group("output")
    out.add_argument("-o", "--output", default=None, metavar="FILE", help="write the script to FILE instead of stdout")
    out.add_argument("--submit", action="store_true", help="submit it with sbatch and print the job id")
    parser.add_argument("script", metavar="SCRIPT", help="the training script every task runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")


def run(args: argparse.Namespace) -> int:
    workers = args.workers if args.workers is not None else (args.gpus_per_node or 1)
    if args.data_nodes is not None and args.data_nodes < 1:
        raise CommandError(f"--data-nodes {args.data_nodes}: expected a whole number >= 1 (nodes of data workers); "
                           f"drop it for a job without data nodes")
    job = SbatchJob(
        script=args.script, script_args=tuple(args.script_args), nodes=args.nodes, workers=workers,
        gpus_per_node=args.gpus_per_node, ps=args.ps, ps_nodes=args.ps_nodes, data_nodes=args.data_nodes or 0,
        data_workers=args.data_workers, data_pipeline=args.data_pipeline, data_partition=args.data_partition,
        data_cpus_per_node=args.data_cpus_per_node,
        data_dir=os.path.abspath(args.data_dir), output_dir=os.path.abspath(args.output_dir), workdir=os.getcwd(),
        python=os.path.abspath(args.python), job_name=args.job_name, time=args.time, partition=args.partition,
        account=args.account, cpus_per_node=args.cpus_per_node, run_args=tuple(args.run_option),
        sbatch_args=tuple(args.sbatch_option), **given_settings(args, "slurm"),
    )
    if job.data_nodes:
        _check_data_pipeline(job)
    text = sbatch_script(job)
    if args.output is not None:
        atomic_write(args.output, text.encode(), mode=0o755)
        # on stderr with --submit, whose stdout is the job id alone (for scripts)
        print(_written(job, args.output, args.submit), file=sys.stderr if args.submit else sys.stdout)
    if not args.submit:
        if args.output is None:
            sys.stdout.write(text)
        return 0
    print(submit(text, args.output))
    return 0


def _check_data_pipeline(job: SbatchJob) -> None:
    """Build --data-pipeline here, from the job's working folder or the script's, as every data worker will: a name
    that does not resolve is refused before sbatch, not after the job waited in the queue."""
    try:
        check_pipeline(job.data_pipeline, [job.workdir, os.path.dirname(os.path.abspath(job.script))])
    except DataServiceError as e:
        raise CommandError(f"{e} (conveyor slurm builds it here before writing the job)") from None


def _written(job: SbatchJob, path: str, submitting: bool) -> str:
    nodes = f"{job.nodes} node{'s' if job.nodes != 1 else ''}"
    text = f"wrote {path}: the sbatch script of conveyor job {job.name} ({job.script} on {nodes})"
    return text if submitting else f"{text}; submit it with `sbatch {shlex.quote(path)}` (squeue --me shows it)"


def submit(text: str, path: str | None) -> str:
    """sbatch the script (the file at ``path`` when given, else ``text`` on stdin); the job id."""
    if shutil.which("sbatch") is None:
        raise CommandError("sbatch is not on PATH: run `conveyor slurm --submit` where Slurm's commands are (a login "
                           "node), or write the script with -o job.sbatch and submit it there", exit_code=1)
    argv = ["sbatch", "--parsable"] + ([path] if path is not None else [])
    try:
        done = subprocess.run(argv, input=None if path is not None else text, capture_output=True, text=True,
                              timeout=SUBMIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise CommandError(f"sbatch did not answer within {SUBMIT_TIMEOUT:g} s; is slurmctld up? (sinfo)",
                           exit_code=1) from None
    if done.returncode != 0:
        raise CommandError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}", exit_code=1)
    return done.stdout.strip().split(";")[0]  # --parsable: "<id>" or "<id>;<cluster>"


COMMAND = Command("slurm", "write (and submit) the sbatch script of a job on a Slurm cluster", add_arguments, run)
