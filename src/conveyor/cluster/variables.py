"""conveyor's own environment variables: every ``CONVEYOR_*`` name, defined once, with who sets and reads it.

Each module that writes or reads one imports its constant from here, so a launcher and the process
it starts cannot drift apart about a name. (TensorFlow's ``TF_CONFIG`` and torch's/torchrun's variables
keep their own names; see :mod:`conveyor.cluster.env` and :mod:`conveyor.launch.plan`.)

Each entry: the meaning; who sets it → who reads it.

``CONVEYOR_TASK_TYPE``
    This task's job: ``chief``, ``worker``, ``ps`` or ``evaluator``.
    ``conveyor run``, every task → discovery (``conveyor.init()``).
``CONVEYOR_TASK_INDEX``
    This task's index within its job. ``conveyor run``, every task → discovery.
``CONVEYOR_STRATEGY``
    The strategy name (``allreduce``, ``ps-ssp:4``...; :mod:`conveyor.cluster.strategy_name`).
    ``conveyor run`` (``--strategy``, else the default), or the user → ``conveyor.init()``, the ps task.
``CONVEYOR_DATA_DIR``
    The job's data folder. ``conveyor run`` (``--data-dir``), or the user → ``conveyor.init()`` (``job.data_dir``).
``CONVEYOR_OUTPUT_DIR``
    The job's output folder (checkpoints, logs, metrics). ``conveyor run`` (``--output-dir``), or the user →
    ``conveyor.init()`` (``job.output_dir``), the ps task (its checkpoint shards).
``CONVEYOR_JOB_SECRET``
    The job's message-signing key, in hex. ``conveyor run``, every task → ``conveyor.init()``, the ps task.
    Also read by ``conveyor run`` itself, as the job's secret, when the user sets it (e.g. from a Kubernetes Secret).
``CONVEYOR_JOB_SECRET_FILE``
    A file (mode 600) holding that key. The user → ``conveyor run`` (like ``--job-secret-file``).
``CONVEYOR_RESTART_COUNT``
    How many times the job was restarted (0 the first time). ``conveyor run``'s supervisor, per attempt →
    ``conveyor.init()`` (``job.restart_count``).
``CONVEYOR_RESUME``
    ``0``: start over, ignoring existing checkpoints. ``conveyor run`` (``--no-resume``) → ``conveyor.init()``
    (``job.resume``).
``CONVEYOR_TIMEOUT``
    Seconds that bound the rendezvous and every collective (default 300). ``conveyor run`` (``--timeout``),
    or the user → ``conveyor.init()`` (``job.timeout``).
``CONVEYOR_TTY``
    ``1``: the launcher's own output is a terminal, so the chief may redraw a progress bar.
    ``conveyor run``'s supervisor → the trainer's progress bar (``conveyor.train.progress``).
``CONVEYOR_OMP_DEFAULT``
    ``1``: ``OMP_NUM_THREADS=1`` is the launcher's default (several tasks on one machine, as torchrun does),
    not the user's choice. ``conveyor run`` → ``conveyor.init()``, which gives each training task its
    share of the cores instead.
"""

from __future__ import annotations

__all__ = [
    "DATA_DIR_VAR",
    "JOB_SECRET_FILE_VAR",
    "JOB_SECRET_VAR",
    "OMP_DEFAULT_VAR",
    "OUTPUT_DIR_VAR",
    "RESTART_COUNT_VAR",
    "RESUME_VAR",
    "STRATEGY_VAR",
    "TASK_INDEX_VAR",
    "TASK_TYPE_VAR",
    "TIMEOUT_VAR",
    "TTY_VAR",
    "VARIABLES",
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
TIMEOUT_VAR = "CONVEYOR_TIMEOUT"
TTY_VAR = "CONVEYOR_TTY"
OMP_DEFAULT_VAR = "CONVEYOR_OMP_DEFAULT"

#: Every ``CONVEYOR_*`` variable, in the table's order.
VARIABLES: tuple[str, ...] = (
    TASK_TYPE_VAR, TASK_INDEX_VAR, STRATEGY_VAR, DATA_DIR_VAR, OUTPUT_DIR_VAR, JOB_SECRET_VAR, JOB_SECRET_FILE_VAR,
    RESTART_COUNT_VAR, RESUME_VAR, TIMEOUT_VAR, TTY_VAR, OMP_DEFAULT_VAR,
)
