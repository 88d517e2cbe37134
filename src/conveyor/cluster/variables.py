"""conveyor's own environment variables: every ``CONVEYOR_*`` name, defined once, with who sets and reads it.

    env[TIMEOUT_VAR]                          # every writer and reader imports the constant from here
    for v in VARIABLES: print(v.name, v.meaning, v.set_by, v.read_by)     # the table, for users

:data:`VARIABLES` is the table: each variable, what it means, who sets it and who reads it. A launcher
and the process it starts cannot drift apart about a name. TensorFlow's ``TF_CONFIG`` and torch's and
torchrun's variables keep their own names (:mod:`conveyor.cluster.env`, :mod:`conveyor.launch.plan`).
The job's settings among them (strategy, timeout, pipeline, ...) are declared with their flags and checks
in :mod:`conveyor.cluster.settings`, which writes and reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CHECKPOINT_ASYNC_VAR",
    "DATA_DIR_VAR",
    "DATA_SERVICE_VAR",
    "FAST_EXIT_VAR",
    "FAULT_VAR",
    "FSDP_BLOCKS_VAR",
    "FSDP_RESHARD_VAR",
    "JOB_SECRET_FILE_VAR",
    "JOB_SECRET_VAR",
    "NAMES",
    "OMP_DEFAULT_VAR",
    "OUTPUT_DIR_VAR",
    "OUTPUT_LOCK_VAR",
    "PIPELINE_MICROBATCHES_VAR",
    "PIPELINE_SCHEDULE_VAR",
    "PIPELINE_SHARD_VAR",
    "PIPELINE_SPLIT_VAR",
    "PIPELINE_STAGES_VAR",
    "PORT_RANGE_VAR",
    "PIPELINE_VARS",
    "RESTART_COUNT_VAR",
    "REJOIN_VAR",
    "RESUME_VAR",
    "ROUND_VAR",
    "SHARE_GPUS_VAR",
    "STRATEGY_VAR",
    "TASK_INDEX_VAR",
    "TASK_TYPE_VAR",
    "TIMEOUT_VAR",
    "TTY_VAR",
    "VARIABLES",
    "Variable",
    "WARM_START_VAR",
]

TASK_TYPE_VAR = "CONVEYOR_TASK_TYPE"
TASK_INDEX_VAR = "CONVEYOR_TASK_INDEX"
STRATEGY_VAR = "CONVEYOR_STRATEGY"
DATA_DIR_VAR = "CONVEYOR_DATA_DIR"
OUTPUT_DIR_VAR = "CONVEYOR_OUTPUT_DIR"
JOB_SECRET_VAR = "CONVEYOR_JOB_SECRET"
JOB_SECRET_FILE_VAR = "CONVEYOR_JOB_SECRET_FILE"
RESTART_COUNT_VAR = "CONVEYOR_RESTART_COUNT"
RESUME_VAR = "CONVEYOR_RESUME"
REJOIN_VAR = "CONVEYOR_REJOIN"
ROUND_VAR = "CONVEYOR_ROUND"
TIMEOUT_VAR = "CONVEYOR_TIMEOUT"
TTY_VAR = "CONVEYOR_TTY"
OMP_DEFAULT_VAR = "CONVEYOR_OMP_DEFAULT"
SHARE_GPUS_VAR = "CONVEYOR_SHARE_GPUS"
PIPELINE_STAGES_VAR = "CONVEYOR_PIPELINE_STAGES"
PIPELINE_MICROBATCHES_VAR = "CONVEYOR_PIPELINE_MICROBATCHES"
PIPELINE_SCHEDULE_VAR = "CONVEYOR_PIPELINE_SCHEDULE"
PIPELINE_SPLIT_VAR = "CONVEYOR_PIPELINE_SPLIT"
PIPELINE_SHARD_VAR = "CONVEYOR_PIPELINE_SHARD_STAGES"
OUTPUT_LOCK_VAR = "CONVEYOR_OUTPUT_LOCK"
FAULT_VAR = "CONVEYOR_FAULT"
FSDP_BLOCKS_VAR = "CONVEYOR_FSDP_BLOCKS"
FSDP_RESHARD_VAR = "CONVEYOR_FSDP_RESHARD"
DATA_SERVICE_VAR = "CONVEYOR_DATA_SERVICE"
CHECKPOINT_ASYNC_VAR = "CONVEYOR_CHECKPOINT_ASYNC"
PORT_RANGE_VAR = "CONVEYOR_PORT_RANGE"
FAST_EXIT_VAR = "CONVEYOR_FAST_EXIT"
WARM_START_VAR = "CONVEYOR_WARM_START"
#: ``conveyor run --stages/--microbatches/--schedule/--split``, by flag (read by the pipeline strategy)
PIPELINE_VARS = {"stages": PIPELINE_STAGES_VAR, "microbatches": PIPELINE_MICROBATCHES_VAR,
                 "schedule": PIPELINE_SCHEDULE_VAR, "split": PIPELINE_SPLIT_VAR}


@dataclass(frozen=True)
class Variable:
    """One row of the table: the variable, what it means, who sets it, who reads it."""

    name: str
    meaning: str
    set_by: str
    read_by: str


_RUN = "`conveyor run`"
_INIT = "conveyor.init()"
_PIPE = f"{_INIT} (job.settings), for the pipeline strategy"

#: Every ``CONVEYOR_*`` variable: the table users read to know what a task is told and what they may set.
VARIABLES: tuple[Variable, ...] = (
    Variable(TASK_TYPE_VAR, "this task's job: chief, worker, ps or evaluator", f"{_RUN}, on every task",
             f"discovery ({_INIT})"),
    Variable(TASK_INDEX_VAR, "this task's index within its job", f"{_RUN}, on every task", f"discovery ({_INIT})"),
    Variable(STRATEGY_VAR, "the strategy name (allreduce, ps-ssp:4, ...; conveyor.cluster.strategy_name)",
             f"{_RUN} (--strategy, else the default), or the user", f"{_INIT}; the ps task"),
    Variable(DATA_DIR_VAR, "the job's data folder", f"{_RUN} (--data-dir), or the user", f"{_INIT} (job.data_dir)"),
    Variable(OUTPUT_DIR_VAR, "the job's output folder: checkpoints, logs, metrics",
             f"{_RUN} (--output-dir), or the user", f"{_INIT} (job.output_dir); the ps task (its checkpoint shards)"),
    Variable(JOB_SECRET_VAR, "the job's message-signing key, in hex",
             f"{_RUN}, on every task; the user, for {_RUN} itself (e.g. from a Kubernetes Secret)",
             f"{_INIT}; the ps task; {_RUN} (the job's secret)"),
    Variable(JOB_SECRET_FILE_VAR, "a file (mode 600) holding the job's secret, like --job-secret-file", "the user",
             _RUN),
    Variable(RESTART_COUNT_VAR, "how many times the job was restarted (0 the first time)",
             f"{_RUN}'s supervisor, per attempt", f"{_INIT} (job.restart_count)"),
    Variable(ROUND_VAR, "an elastic job's membership round (--nnodes MIN:MAX): 0, then + 1 each time the machines "
             "change; unset in a job of fixed size", f"{_RUN}, per round (launch/elastic.py)", "the user's script"),
    Variable(REJOIN_VAR, "1: this worker replaces one of a ps-async/ps-ssp job that died, restarted alone while the ps "
             "tasks and the other workers go on: it takes its step and data position from the parameter servers "
             "(PSClient.rejoin) and joins no process group", f"{_RUN}'s supervisor (docs/ps.md, \"A worker restarted "
             "alone\")", f"{_INIT} (job.rejoining)"),
    Variable(RESUME_VAR, "0: start over, ignoring the checkpoints already there", f"{_RUN} (--no-resume)",
             f"{_INIT} (job.resume)"),
    Variable(TIMEOUT_VAR, "seconds that bound the rendezvous and every collective (default 300)",
             f"{_RUN} (--timeout), or the user", f"{_INIT} (job.timeout)"),
    Variable(TTY_VAR, "1: the launcher's own output is a terminal, so the chief may redraw a progress bar",
             f"{_RUN}'s supervisor", "the trainer's progress bar (conveyor.train.progress)"),
    Variable(OMP_DEFAULT_VAR, "1: OMP_NUM_THREADS=1 is the launcher's default (several tasks on one machine, as "
             "torchrun does), not the user's choice", _RUN,
             f"{_INIT}, which gives each training task its share of the cores instead"),
    Variable(SHARE_GPUS_VAR, "1: more training tasks than visible GPUs on a machine may share GPUs (their "
             "collectives then go through gloo: NCCL refuses two ranks on one GPU); otherwise that is refused",
             f"{_RUN} (--share-gpus), or the user", f"{_INIT} (its share_gpus argument wins)"),
    Variable(PIPELINE_STAGES_VAR, "pipeline stages S per replica", f"{_RUN} (--stages), or the user",
             _PIPE),
    Variable(PIPELINE_MICROBATCHES_VAR, "microbatches M per step (default 2 S, or less to divide the batch)",
             f"{_RUN} (--microbatches)", _PIPE),
    Variable(PIPELINE_SCHEDULE_VAR, "1f1b (default) or gpipe", f"{_RUN} (--schedule)", _PIPE),
    Variable(PIPELINE_SPLIT_VAR, "layer names to cut the model before, comma-separated", f"{_RUN} (--split)",
             _PIPE),
    Variable(PIPELINE_SHARD_VAR, "1: shard each stage with FSDP2 across its replicas (pipeline × FSDP)",
             f"{_RUN} (--shard-stages)", _PIPE),
    Variable(OUTPUT_LOCK_VAR, "the output folder's lock file, held by the launcher for the whole job",
             _RUN, f"{_INIT}, which then does not take the lock again (conveyor.cluster.output_lock)"),
    Variable(FAULT_VAR, "TEST ONLY: <task>:<point>[:<step>] kills that task at that point of a checkpoint "
             "save (or after-step), in the first attempt",
             "the crash tests (tests/train/test_save_crash.py), benchmarks/elastic.py's stall", "conveyor.fault"),
    Variable(FSDP_BLOCKS_VAR, "the modules to shard one by one (named_modules names), comma-separated",
             f"{_RUN} (--fsdp-blocks), or the user", f"{_INIT} (job.settings), for the fsdp strategy"),
    Variable(FSDP_RESHARD_VAR, "0: keep the gathered parameters from forward to backward (ZeRO-2-like)",
             f"{_RUN} (--no-reshard-after-forward), or the user", f"{_INIT} (job.settings), for the fsdp strategy"),
    Variable(DATA_SERVICE_VAR, "HOST:PORT of the job's data service dispatcher (docs/data-service.md)",
             f"{_RUN} (--data-workers K), on every task; or the user",
             "conveyor.data.service.from_env() (`dataset.distribute(from_env())`)"),
    Variable(CHECKPOINT_ASYNC_VAR, "1: the Trainer writes each checkpoint in the background, training blocked only "
             "while the state is copied (default: written before training goes on)", f"{_RUN} (--checkpoint-async), "
             "or the user",
             f"{_INIT} (job.settings), for the Trainer"),
    Variable(PORT_RANGE_VAR, "LOW-HIGH: take the tasks' free ports from this range, not the kernel's ephemeral one",
             "the user; the parallel test suite, one range per worker (tests/conftest.py)",
             f"{_RUN} and conveyor.launch.free_ports"),
    Variable(FAST_EXIT_VAR, "1: a training task leaves without the garbage collector's passes over what it imported "
             "(conveyor.exiting; objects still reachable at exit are not finalized one by one)",
             "the user; the test suite (tests/conftest.py)",
             "conveyor.init (conveyor.train.job); a conveyor command that loads a data pipeline (conveyor.exiting)"),
    Variable(WARM_START_VAR, "1: the launcher forks each task from a template process with torch imported, 0: "
             "a new interpreter each (docs/launcher.md, Warm starts)", "the user (the default of conveyor run's "
             "--warm-start); tests/launch/test_warm.py", f"{_RUN} (conveyor.launch.warm)"),
)

#: The names alone, in the table's order.
NAMES: tuple[str, ...] = tuple(v.name for v in VARIABLES)
