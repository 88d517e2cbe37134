"""`conveyor run`: start one training script as every task of a job, and keep the job alive.

    conveyor run -n 2 train.py --epochs 1                     # 2 workers on this machine
    conveyor run -n 4 --ps 2 --strategy ps-async train.py     # 4 workers, 2 parameter servers
    conveyor run -n 4 --strategy pipeline --stages 2 train.py # 2 pipeline replicas of 2 stages
    conveyor run --dry-run -n 2 train.py --epochs 1           # print what would start, start nothing
    conveyor run -n 4 --bind socket train.py                  # each task on one socket's cores
    conveyor run -n 2 --data-workers 4 --data-pipeline job.input:train train.py   # + the data service
    conveyor run -n 2 --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29400 --job-secret-file s train.py  # 10.0.0.1
    conveyor run -n 2 --nnodes 2 --node-rank 1 --rdzv 10.0.0.1:29400 --job-secret-file s train.py  # the other
    conveyor run -n 2 --nnodes 2:4 --node-rank 0 --rdzv 10.0.0.1:29400 --job-secret-file s train.py  # elastic
    conveyor run -n 2 --nnodes 2:4 --rdzv 10.0.0.1:29400 --job-secret-file s train.py    # each of the others

This module only parses arguments; the work is in `conveyor.launch`: `plan` (what to start, pure),
`ports`, `rendezvous` (several machines), `elastic` (--nnodes MIN:MAX) and `supervisor` (start, relay
logs, restart, stop).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from conveyor.cli import Command, CommandError
from conveyor.cluster.output_lock import OutputDirBusyError, OutputLock, lock_path
from conveyor.cluster.secret import parse_secret, read_secret_file
from conveyor.cluster.settings import add_arguments as add_settings
from conveyor.cluster.settings import agreed_flags
from conveyor.cluster.settings import given as given_settings
from conveyor.cluster.validate import seconds as valid_seconds
from conveyor.cluster.variables import JOB_SECRET_FILE_VAR, JOB_SECRET_VAR, OUTPUT_LOCK_VAR, WARM_START_VAR
from conveyor.data.service.pipelines import check_pipeline
from conveyor.data.service.protocol import DataServiceError
from conveyor.fileio import atomic_write
from conveyor.launch import (
    OMP_DEFAULT_VAR,
    PeerError,
    RunOptions,
    Supervisor,
    build_plan,
    describe_plan,
    free_ports,
    join,
    local_plan,
    warm,
)
from conveyor.launch.binding import BIND_MODES
from conveyor.launch.elastic import JobEnded, Membership, NodeSpan, parse_nnodes
from conveyor.launch.plan import DATA_REPORT
from conveyor.launch.restarts import DELAY_CAP as RESTART_DELAY_CAP
from conveyor.launch.restarts import RestartPolicy
from conveyor.launch.slurm import allocation_note, in_step, slurm_node

MAKE_SECRET = (f"make one with `openssl rand -hex 32 > job.secret && chmod 600 job.secret`, copy the same file to "
               f"every node and pass --job-secret-file job.secret (or set {JOB_SECRET_FILE_VAR} to its path, or "
               f"{JOB_SECRET_VAR} to its hex digits, e.g. from a Kubernetes Secret)")

EXAMPLES = """\
examples:
  conveyor run -n 2 train.py --epochs 1
  conveyor run -n 4 --ps 2 --strategy ps-async train.py
  conveyor run -n 4 --strategy pipeline --stages 2 --microbatches 8 train.py   # 2 replicas x 2 stages
  conveyor run -n 2 --strategy pipeline --split blocks.2 train.py    # a model with its own forward: traced
  conveyor run --dry-run -n 2 train.py --epochs 1
  conveyor run -n 2 --data-workers 2 --data-pipeline myjob.input:train train.py   # the input on 2 data workers
  conveyor run -n 8 --bind socket train.py       # one task per GPU, each on one socket's cores
  conveyor run --chief -n 3 --ps 1 --linger 5 tf2_ps_train.py     # TF2 parameter-server tutorial pattern
  conveyor run -n 2 --ps 1 --tf-flags trainer.py                  # TF1: --ps_hosts ... --task_index
  openssl rand -hex 32 > job.secret && chmod 600 job.secret    # once, copied to every machine
  conveyor run -n 2 --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29400 --job-secret-file job.secret train.py
  conveyor run -n 2 --nnodes 2 --node-rank 1 --rdzv 10.0.0.1:29400 --job-secret-file job.secret train.py
  conveyor run -n 2 --nnodes 2:4 --node-rank 0 --rdzv 10.0.0.1:29400 --job-secret-file job.secret train.py
  conveyor run -n 2 --nnodes 2:4 --rdzv 10.0.0.1:29400 --job-secret-file job.secret train.py  # 1 to 3 more

Every task runs `PYTHON SCRIPT ARGS...` with the caller's environment plus TF_CONFIG, torchrun's RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and conveyor's CONVEYOR_* variables (--dry-run shows
them). Tasks are worker:0..N-1 (chief:0 first with --chief); rank 0 is the chief that writes checkpoints.
Output lines are prefixed with the task ([worker:1] ...); full logs go to OUTPUT_DIR/logs/. When a task
fails, every task is stopped and the job restarts (CONVEYOR_RESTART_COUNT + 1) up to --max-restarts
times, after --restart-delay seconds (doubled after each failure without a new checkpoint, at most
30 s); the script resumes from OUTPUT_DIR/checkpoints. The same failure 3 times in a row without a new
checkpoint ends the job early. Ctrl-C stops every task, and so does the launcher's death (Linux).
When the job succeeds (Kubeflow TFJob's rule: when the chief exits 0, with --chief; else when every
worker has exited 0), tasks still running - parameter servers, TensorFlow 2 workers blocked in
server.join() - get --linger seconds to exit, then SIGTERM, 5 s, SIGKILL; the job's status is 0
whatever they do then, also when one of them failed in the same instant. A task failing before that
(the chief, or a ps or worker it needs) restarts the job as above. TensorFlow 1 scripts that read
--ps_hosts/--worker_hosts/--job_name/--task_index get them with --tf-flags; torchrun scripts find
every variable torchrun sets (GROUP_RANK, ROLE_RANK, TORCHELASTIC_RESTART_COUNT...) and, when several
tasks share the machine and OMP_NUM_THREADS is unset, OMP_NUM_THREADS=1, as torchrun gives.
On a machine with GPUs each training task uses GPU LOCAL_RANK (of those CUDA_VISIBLE_DEVICES shows);
more training tasks than GPUs is refused unless --share-gpus. --bind core gives every task of this
machine its own equal set of physical cores, --bind socket the cores of one socket (round robin),
and sets OMP_NUM_THREADS to that many cores unless it is set; --dry-run shows each task's cpus.
With --nnodes, -n and --ps count this machine's tasks (like torchrun's --nproc-per-node; -n 0 --ps M
is a machine of parameter servers only, not node 0); node 0's tasks come first in the cluster, so
rank 0 runs on node 0. A machine silent for --timeout seconds ends the job on every node, naming
it. A job on several machines needs the same job secret on every node (--job-secret-file,
CONVEYOR_JOB_SECRET_FILE or CONVEYOR_JOB_SECRET): it signs the parameter-server messages and never
crosses the network. --nnodes MIN:MAX is elastic: node 0 (--node-rank 0, the only rank given) hosts
the rendezvous and must stay; the others join in membership rounds, a lost node's survivors go on
without it while MIN remain, a late node joins at the next checkpoint or restart (docs/launcher.md).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    job = parser.add_argument_group("the job")
    job.add_argument("-n", "--workers", type=int, default=1, metavar="N",
                     help="training processes on this machine (default 1; 0 with --ps on a node of parameter servers "
                     "only, not node 0)")
    job.add_argument("--ps", type=int, default=0, metavar="M",
                     help="parameter servers on this machine (default 0)")
    job.add_argument("--data-workers", type=int, default=0, metavar="K",
                     help="data-service workers on this machine (default 0), each running --data-pipeline; the "
                     "job's dispatcher runs on node 0, and every task finds it in $CONVEYOR_DATA_SERVICE "
                     "(dataset.distribute(conveyor.data.service.from_env()); docs/data-service.md)")
    job.add_argument("--data-pipeline", default=None, metavar="MODULE:FUNCTION",
                     help="the function (no arguments) returning the conveyor.data.Dataset the data workers run, "
                     "imported from the current folder, the script's folder or PYTHONPATH")
    job.add_argument("--linger", type=float, default=30.0, metavar="SECONDS",
                     help="once the job has succeeded (see below), how long tasks still running may take to exit "
                     "by themselves before they are stopped (default 30)")
    job.add_argument("--data-dir", default="data", metavar="D", help="the job's input folder (default ./data)")
    job.add_argument("--output-dir", default="output", metavar="O",
                     help="checkpoints, logs, metrics (default ./output)")
    job.add_argument("--restart-delay", type=float, default=1.0, metavar="SECONDS",
                     help="pause before a restart (default 1), doubled after each failure without a new "
                     f"checkpoint, at most {RESTART_DELAY_CAP:g} s (or SECONDS, if larger)")
    job.add_argument("--python", default=sys.executable, metavar="PATH",
                     help="interpreter that runs SCRIPT (default: the one running conveyor)")
    job.add_argument("--job-secret-file", default=None, metavar="FILE",
                     help="the job's message-signing secret as hex digits, in a file only you can read (chmod "
                     f"600); default: ${JOB_SECRET_FILE_VAR}, ${JOB_SECRET_VAR}, else a fresh random one on one "
                     "machine. Required with --nnodes > 1: give every node the same file")
    job.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=None,
                     help="fork each task (every restart too) from a process that has torch imported, started with "
                     f"the launcher, instead of a new interpreter (default: ${WARM_START_VAR}=1, else off; "
                     "docs/launcher.md, Warm starts)")
    job.add_argument("--dry-run", action="store_true", help="print every task's command and environment; start nothing")
    place = parser.add_argument_group("placement: CPUs and GPUs")
    place.add_argument("--bind", default="none", choices=BIND_MODES,
                       help="pin each task of this machine to CPUs: core (an equal share of whole physical cores "
                       "each), socket (one socket's cores, tasks round robin over sockets), none (default)")
    pipe = parser.add_argument_group("pipeline parallelism (--strategy pipeline)")
    add_settings(dict(job=job, placement=place, pipeline=pipe), "run")  # --strategy, --timeout, --stages, ...
    nodes = parser.add_argument_group("several machines")
    nodes.add_argument("--nnodes", type=_node_span, default=None, metavar="K|MIN:MAX",
                       help="machines in the job (default 1; in an srun step: the step's nodes); MIN:MAX: elastic, "
                       "the job goes on with any number of machines from MIN to MAX")
    nodes.add_argument("--node-rank", type=int, default=None, metavar="I",
                       help="this machine's rank, 0..K-1; elastic: 0 on the machine that hosts the rendezvous, none "
                       "on the others (each round ranks them)")
    nodes.add_argument("--rdzv", default=None, metavar="HOST:PORT",
                       help="where node 0's launcher hosts the rendezvous (an address of node 0, a free port)")
    nodes.add_argument("--rdzv-last-call", type=float, default=5.0, metavar="SECONDS",
                       help="elastic: once MIN machines are there, how long a round waits for one more (default 5)")
    nodes.add_argument("--node-timeout", type=float, default=None, metavar="SECONDS",
                       help="elastic: a machine whose launcher is silent this long is lost and the job goes on "
                       "without it (default: --timeout)")
    parser.add_argument("script", metavar="SCRIPT", help="the training script every task runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")


def _node_span(text: str) -> NodeSpan:
    try:
        return parse_nnodes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    options = RunOptions(
        script=args.script, script_args=tuple(args.script_args), workers=args.workers, ps=args.ps,
        data_dir=os.path.abspath(args.data_dir), output_dir=os.path.abspath(args.output_dir),
        restart_delay=args.restart_delay, python=args.python, linger=args.linger, bind=args.bind,
        data_workers=args.data_workers, data_pipeline=args.data_pipeline, **given_settings(args, "run"),
    )
    environ = dict(os.environ)  # before anything here touches os.environ: this is what the tasks inherit
    _from_slurm(args, environ)
    _check_node_flags(args)
    _check_data_pipeline(options)
    secret = _job_secret(args.job_secret_file, environ, args.nnodes)
    if args.dry_run:
        plan = local_plan(options, free_ports(options.tasks_per_node), master_port=free_ports(1)[0],
                          secret=secret, environ=environ)
        print(describe_plan(plan))
        if not os.path.isfile(options.script):
            print(f"\nnote: {options.script} does not exist in {os.getcwd()}")
        return 0
    if not os.path.isfile(options.script):
        raise CommandError(f"{options.script}: no such file (the script every task runs)")
    _warm_start(args.warm_start, options, environ)
    if args.nnodes == 1:
        ports = free_ports(options.tasks_per_node + 1)  # one per task, one for torch's store (MASTER_PORT)
        # the tasks are told where the lock is before it is taken: the plan is checked first, so that a job
        # refused for its flags leaves nothing behind, not even the output folder
        environ[OUTPUT_LOCK_VAR] = str(lock_path(options.output_dir))
        plan = local_plan(options, ports[:-1], master_port=ports[-1], secret=secret, environ=environ)
        with _locked_output(options.output_dir, environ):
            supervisor = _supervisor(plan, options)
            result = supervisor.run()
            data_service_summary(plan, supervisor.data_worker_exits, options.output_dir)
            return _report(result, options.output_dir)
    with _locked_output(options.output_dir, environ) if args.node_rank == 0 else contextlib.nullcontext():
        if args.span.elastic:
            return _run_elastic(args, options, environ, secret)
        return _run_node(args, options, environ, secret)


def _warm_start(flag: bool | None, options: RunOptions, environ: Mapping[str, str]) -> None:
    """Start the warm-start template now, importing while the launcher plans and meets the other nodes; only for
    tasks run by this interpreter (the template is one), and a script that imports torch or conveyor itself
    (another would not wait for the template: its imports would be for nothing)."""
    wanted = flag if flag is not None else environ.get(WARM_START_VAR) == "1"
    same = os.path.abspath(options.python) == os.path.abspath(sys.executable)
    same = same and warm.imports_torch((options.python, options.script))
    # what every task's environment has beyond the caller's, among the variables read at start-up (plan.py)
    warm.configure(wanted and same, python=sys.executable, environ={**environ, "PYTHONUNBUFFERED": "1"})


@contextlib.contextmanager
def _locked_output(output_dir: str, environ: dict[str, str]) -> Iterator[OutputLock]:
    """The output folder's lock, held by this launcher for the whole job (node 0's, where several nodes share
    the folder); its tasks are told, so that rank 0's `conveyor.init()` does not take it again."""
    try:
        lock = OutputLock.acquire(output_dir)
    except OutputDirBusyError as e:
        raise CommandError(str(e), exit_code=1) from None
    environ[OUTPUT_LOCK_VAR] = str(lock.path)
    try:
        yield lock
    finally:
        lock.release()


def _supervisor(plan, options: RunOptions, peers=None, **more) -> Supervisor:
    note = omp_note(plan)
    if note is not None:
        print(note, file=sys.stderr)
    return Supervisor(plan, policy=RestartPolicy.for_run(options.max_restarts, options.restart_delay), peers=peers,
                      linger=options.linger, **more)


#: What a job leaves in its output folder, as the last line names it: the Trainer's files and the launcher's logs
OUTPUTS = ("checkpoints/", "metrics.jsonl", "summary.json", "trace/", "plots/", "tensorboard/", "logs/")


def outputs_line(output_dir: str) -> str:
    """The run's last line: where its outputs went (what of :data:`OUTPUTS` is there; a plain script may
    write none of the Trainer's files)."""
    there = [name for name in OUTPUTS if os.path.exists(os.path.join(output_dir, name.rstrip("/")))]
    return f"[conveyor] outputs in {output_dir}" + (f": {', '.join(there)}" if there else "")


def omp_note(plan) -> str | None:
    """One short line when the launcher chose OMP_NUM_THREADS=1 (torchrun's default) for this machine's tasks:
    it changes how fast a plain script runs. conveyor.init() then gives its training tasks their share of the
    cores instead, so the line says no more than what was set and how to choose."""
    if not any(t.env.get(OMP_DEFAULT_VAR) == "1" for t in plan.tasks):
        return None
    return f"[conveyor] OMP_NUM_THREADS=1 for the {len(plan.tasks)} tasks here (unset; as torchrun); set it to choose"


#: The flags every node of a job must give alike (the settings declared ``agreed``): each node plans its own
#: tasks from them, so a difference would split the job (two pipeline cuts, two strategies) instead of
#: failing at the rendezvous.
AGREED_FLAGS = agreed_flags()


def node_settings(options: RunOptions) -> dict:
    """What this node publishes at the rendezvous for the others to compare: ``AGREED_FLAGS``, and the script
    with its arguments (theirs by a sha256 only: they may hold what the store must not show)."""
    args = hashlib.sha256(json.dumps(list(options.script_args)).encode()).hexdigest()[:16]
    return {**options.agreed(), "script": options.script, "script_args": args}


def _run_node(args: argparse.Namespace, options: RunOptions, environ: dict[str, str], secret: bytes) -> int:
    settings = node_settings(options)
    try:
        rdzv = join(args.rdzv, nnodes=args.nnodes, node_rank=args.node_rank, workers=options.workers, ps=options.ps,
                    settings=settings, secret=secret, timeout=options.timeout, data_workers=options.data_workers)
    except PeerError as e:
        raise CommandError(str(e), exit_code=1) from None
    try:
        try:
            plan = build_plan(options, rdzv.nodes, rdzv.node_rank, master_addr=rdzv.master_addr,
                              master_port=rdzv.master_port, secret=rdzv.secret, environ=environ,
                              dispatcher_port=rdzv.dispatcher_port)
        except Exception as e:  # the others would wait for this node's tasks until --timeout: tell them now
            with contextlib.suppress(PeerError):
                rdzv.peers.abort(f"node {rdzv.node_rank}'s launcher cannot start its tasks: {e}")
            raise
        print(f"[conveyor] node {rdzv.node_rank} of {args.nnodes}: cluster {plan.spec.as_dict()}", file=sys.stderr)
        supervisor = _supervisor(plan, options, peers=rdzv.peers)
        result = supervisor.run()
        data_service_summary(plan, supervisor.data_worker_exits, options.output_dir)
    finally:
        rdzv.peers.close()
    return _report(result, options.output_dir)


def _run_elastic(args: argparse.Namespace, options: RunOptions, environ: dict[str, str], secret: bytes) -> int:
    """``--nnodes MIN:MAX``: one supervisor per membership round, until the job ends (launch/elastic.py)."""
    try:
        members = Membership(args.rdzv, args.span, host=args.node_rank == 0, workers=options.workers, ps=options.ps,
                             settings=node_settings(options), secret=secret, timeout=options.timeout,
                             last_call=args.rdzv_last_call, node_timeout=args.node_timeout or options.timeout,
                             checkpoint_dir=os.path.join(options.output_dir, "checkpoints"))
    except PeerError as e:
        raise CommandError(str(e), exit_code=1) from None
    result, attempt, history, recovering = None, 0, (), None
    try:
        while result is None or result.regroup:
            if result is not None:
                print(f"[conveyor] {result.message}; every task here stopped, asking for the next round",
                      file=sys.stderr, flush=True)
            try:
                rnd = members.next_round(attempt)
            except JobEnded as e:
                print(f"[conveyor] the job ended before this node was needed: {e}", file=sys.stderr)
                return 0 if e.ok else 1
            except PeerError as e:
                raise CommandError(str(e), exit_code=1) from None
            supervisor = _round_supervisor(args, options, environ, secret, rnd, history, recovering)
            result = supervisor.run()
            attempt, history = result.restarts + 1, supervisor.history
            # node 0 (the chief's, which reads them) records what the next round recovers from: one writer
            recovering = supervisor.recovering if rnd.node_rank == 0 else None
    finally:
        members.finish(ok=None if result is None or result.regroup else result.ok, message=result and result.message)
    return _report(result, options.output_dir)


def _round_supervisor(args: argparse.Namespace, options: RunOptions, environ: dict[str, str], secret: bytes, rnd,
                      history: tuple, recovering: dict | None = None) -> Supervisor:
    try:
        plan = build_plan(options, rnd.nodes, rnd.node_rank, master_addr=rnd.master_addr,
                          master_port=rnd.master_port, secret=secret, environ=environ,
                          membership_round=rnd.number)
    except Exception as e:  # the others would wait for this node's tasks until --timeout: tell them now
        with contextlib.suppress(PeerError):
            rnd.peers.abort(f"node {rnd.node_rank}'s launcher cannot start its tasks: {e}")
        raise
    print(f"[conveyor] round {rnd.number}: node {rnd.node_rank} of {len(rnd.nodes)} (--nnodes {args.span}), "
          f"world size {plan.spec.world_size}: cluster {plan.spec.as_dict()}", file=sys.stderr, flush=True)
    return _supervisor(plan, options, peers=rnd.peers, first_attempt=rnd.attempt, history=history,
                       recovering=recovering)


def _check_data_pipeline(options: RunOptions) -> None:
    """Build --data-pipeline here first, as the data workers will (from the current folder, the script's folder or
    PYTHONPATH), so that a name that does not resolve is refused before anything starts."""
    if options.data_pipeline is None:
        return
    if not options.data_workers:
        raise CommandError(f"--data-pipeline {options.data_pipeline} is what data workers run: add --data-workers K "
                           f"(K data workers on this machine), or drop it")
    try:
        check_pipeline(options.data_pipeline, [os.getcwd(), os.path.dirname(os.path.abspath(options.script))])
    except DataServiceError as e:
        raise CommandError(str(e)) from None


def data_service_summary(plan, exits: list[dict], output_dir: str) -> None:
    """On the dispatcher's node: the dispatcher's last figures (logs/data_service.json) and the data workers that
    exited, as the ``data_service`` block of summary.json (the Trainer's, or one of this block alone)."""
    if not any(t.task.type == "dispatcher" for t in plan.tasks):
        return
    path = os.path.join(plan.log_dir, DATA_REPORT)
    try:
        with open(path, encoding="utf-8") as f:
            block = json.load(f)
    except (OSError, ValueError) as e:
        print(f"[conveyor] data service: no figures ({path}: {e})", file=sys.stderr)
        return
    block["data_worker_exits"] = exits
    atomic_write(Path(path), json.dumps(block, indent=1).encode())
    summary = Path(output_dir) / "summary.json"
    try:
        doc = json.loads(summary.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        doc = {}  # a script without the Trainer writes no summary: this block is all of it
    doc = {**doc, "data_service": block} if isinstance(doc, dict) else {"data_service": block}
    atomic_write(summary, json.dumps(doc, indent=1).encode())
    print(f"[conveyor] data service: {block.get('advice')} (summary.json's data_service)", file=sys.stderr)


def _from_slurm(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Inside an srun step of several nodes, --nnodes/--node-rank/--rdzv come from Slurm (launch/slurm.py). An
    elastic --nnodes MIN:MAX is not read from Slurm: a step's nodes are fixed (docs/launcher.md)."""
    span = args.span = args.nnodes
    if span is not None and span.elastic:
        if in_step(environ) and not args.dry_run:
            raise CommandError(f"--nnodes {span} inside an srun step: Slurm gives a step a fixed set of nodes and ends "
                               f"it when one fails (srun --kill-on-bad-exit); drop --nnodes (conveyor run reads the "
                               f"step's nodes from Slurm). A job requeued on fewer nodes resumes on those")
        args.nnodes = span.max
        return
    args.nnodes = span.min if span is not None else None
    node = None if args.dry_run else slurm_node(environ, nnodes=args.nnodes, node_rank=args.node_rank, rdzv=args.rdzv)
    if node is not None:
        args.nnodes, args.node_rank, args.rdzv = node.nnodes, node.node_rank, node.rdzv
        print(f"[conveyor] {node.describe()}", file=sys.stderr)
    elif allocation_note(environ) and args.nnodes is None:
        print(f"[conveyor] note: {allocation_note(environ)}", file=sys.stderr)
    if args.nnodes is None:
        args.nnodes = 1
    args.span = NodeSpan(args.nnodes, args.nnodes)


def _check_node_flags(args: argparse.Namespace) -> None:
    if args.nnodes < 1:
        raise CommandError(f"--nnodes {args.nnodes}: expected 1 or more machines")
    if args.span.elastic:
        _check_elastic_flags(args)
        return
    if args.nnodes == 1:
        if args.node_rank not in (None, 0) or args.rdzv is not None:
            raise CommandError("--node-rank and --rdzv belong to a job on several machines: add --nnodes K")
        if args.workers == 0:
            raise CommandError("-n 0 starts no training process: a machine of parameter servers only (-n 0 --ps M) "
                               "is one node of a job on several machines (--nnodes K --node-rank I, I > 0)")
        return
    if args.node_rank is None or args.rdzv is None:
        raise CommandError(f"--nnodes {args.nnodes} needs --node-rank I (0..{args.nnodes - 1}) and --rdzv HOST:PORT "
                           f"(node 0's address and a free port), the same --rdzv on every machine")
    if not 0 <= args.node_rank < args.nnodes:
        raise CommandError(f"--node-rank {args.node_rank} is out of range for --nnodes {args.nnodes} "
                           f"(0..{args.nnodes - 1})")
    if args.node_rank == 0 and args.workers == 0:
        raise CommandError("-n 0 on node 0: node 0 runs rank 0, the chief, which hosts the process group's store and "
                           "writes the checkpoints; give node 0 -n 1 or more, and the node of parameter servers only "
                           "(-n 0 --ps M) another --node-rank")
    if args.dry_run:
        raise CommandError("--dry-run shows one machine's plan and cannot know the other machines' addresses; "
                           "drop --nnodes/--node-rank/--rdzv to check the command and environment")


def _check_elastic_flags(args: argparse.Namespace) -> None:
    span = args.span
    if args.node_rank not in (None, 0):
        raise CommandError(f"--node-rank {args.node_rank} with --nnodes {span}: in an elastic job each membership "
                           f"round gives the machines their ranks; give --node-rank 0 to the machine that hosts the "
                           f"rendezvous (it keeps rank 0 and must stay up), and no --node-rank to the others")
    if args.rdzv is None:
        raise CommandError(f"--nnodes {span} needs --rdzv HOST:PORT (node 0's address and a free port), the same on "
                           f"every machine, and --node-rank 0 on node 0")
    if args.node_rank == 0 and args.workers == 0:
        raise CommandError("-n 0 on node 0: node 0 runs rank 0, the chief; give node 0 -n 1 or more")
    if args.data_workers:
        raise CommandError(f"--data-workers with --nnodes {span}: an elastic job does not run the data service yet; "
                           f"give a fixed --nnodes K, or drop --data-workers")
    for flag, value, zero_ok in (("--rdzv-last-call", args.rdzv_last_call, True),
                                 ("--node-timeout", args.node_timeout, False)):
        if value is not None:
            try:
                valid_seconds(value, flag, zero_ok=zero_ok, most=86400.0)
            except ValueError as e:
                raise CommandError(str(e)) from None
    if args.dry_run:
        raise CommandError("--dry-run shows one machine's plan and cannot know the other machines' addresses; "
                           "drop --nnodes/--node-rank/--rdzv to check the command and environment")


def _job_secret(path: str | None, environ: Mapping[str, str], nnodes: int) -> bytes:
    """The per-job secret that signs parameter-server messages: from ``--job-secret-file``, then
    ``$CONVEYOR_JOB_SECRET_FILE``, then ``$CONVEYOR_JOB_SECRET``; else, on one machine only, a fresh one
    (it never leaves this machine: the tasks get it in their environment). Its value is never echoed."""
    if path is not None:
        return _read_secret_file(path, "--job-secret-file")
    if environ.get(JOB_SECRET_FILE_VAR):
        return _read_secret_file(environ[JOB_SECRET_FILE_VAR], JOB_SECRET_FILE_VAR)
    if JOB_SECRET_VAR in environ:
        return _parse_secret(environ[JOB_SECRET_VAR], JOB_SECRET_VAR)
    if nnodes > 1:
        raise CommandError(f"--nnodes {nnodes}: a job on several machines needs the same job secret on every node, "
                           f"so that it never crosses the network; {MAKE_SECRET}")
    return secrets.token_bytes(32)


def _read_secret_file(path: str, where: str) -> bytes:
    return read_secret_file(path, where, error=CommandError, fix=MAKE_SECRET)


def _parse_secret(text: str, where: str) -> bytes:
    return parse_secret(text, where, error=CommandError, fix=MAKE_SECRET)


def _report(result, output_dir: str) -> int:
    if result.ok:
        note = f" after {result.restarts} restart(s)" if result.restarts else ""
        print(f"[conveyor] job finished{note}", file=sys.stderr)
        print(outputs_line(output_dir), file=sys.stderr)
        return 0
    if result.signal is not None:
        print(f"conveyor run: {result.message}; every task was stopped", file=sys.stderr)
        return result.exit_code
    lines = [f"conveyor run: error: job failed: {result.message}"]
    failure = result.failure
    if failure is not None:
        lines.append(f"last {len(failure.last_lines)} lines of {failure.log_path}:")
        lines += [f"  | {line}" for line in failure.last_lines]
    print("\n".join(lines), file=sys.stderr)
    return result.exit_code


COMMAND = Command("run", "run a training script as a job of workers and parameter servers", add_arguments, run)
