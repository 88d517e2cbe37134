"""TensorFlow 1's cluster flags: ``--ps_hosts``, ``--worker_hosts``, ``--job_name``, ``--task_index``.

Scripts written for ``tf.train.Server`` took their cluster from the command line::

    python trainer.py --ps_hosts=ps0:2222,ps1:2222 --worker_hosts=w0:2222,w1:2222 --job_name=worker --task_index=1

conveyor accepts the same flags so such a command line keeps working: :func:`parse_cluster_flags` takes
them out of ``argv`` and leaves the rest for the script's own parser. Both ``--flag=value`` and
``--flag value`` are read; everything after a lone ``--`` is left alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.cluster.spec import JOBS, MAX_INDEX, ClusterConfigError, ClusterSpec, TaskId, parse_decimal, show

__all__ = ["CLUSTER_FLAGS", "parse_cluster_flags"]

CLUSTER_FLAGS: tuple[str, ...] = ("ps_hosts", "worker_hosts", "job_name", "task_index")

_EXAMPLE = "--ps_hosts=ps0:2222 --worker_hosts=w0:2222,w1:2222 --job_name=worker --task_index=0"


def parse_cluster_flags(argv: Sequence[str]) -> tuple[ClusterSpec, TaskId, list[str]] | None:
    """``(cluster, task, remaining_argv)`` from TensorFlow's classic flags, or ``None`` if none is given.

    ``--worker_hosts`` and ``--job_name`` are required once any of the four flags appears;
    ``--ps_hosts`` may be left out (an all-reduce job has no ps) and ``--task_index`` defaults to 0, as
    in TensorFlow's example trainers. A flag given twice is an error rather than "last one wins": with
    a generated command line, a repeat is more likely a bug than an override.
    """
    values: dict[str, str] = {}
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest.extend(args[i:])
            break
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name not in CLUSTER_FLAGS:
            rest.append(arg)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ClusterConfigError(f"--{name} needs a value, e.g. {_EXAMPLE}")
            value = args[i + 1]
            i += 1
        if name in values:
            raise ClusterConfigError(f"--{name} is given twice ({show(values[name])} and {show(value)}); "
                                     f"give it once")
        values[name] = value
        i += 1
    if not values:
        return None

    for required in ("worker_hosts", "job_name"):
        if required not in values:
            raise ClusterConfigError(f"--{required} is missing (the cluster flags go together); expected {_EXAMPLE}")
    job_name = values["job_name"].strip()
    if job_name not in JOBS:
        raise ClusterConfigError(f"--job_name={show(job_name)} is not a job; expected one of "
                                 f"{', '.join(JOBS)}, e.g. {_EXAMPLE}")
    index_text = values.get("task_index", "0").strip()
    index = parse_decimal(index_text, MAX_INDEX)
    if index is None:
        raise ClusterConfigError(f"--task_index={show(index_text)} is not a whole number >= 0 (at most {MAX_INDEX}); "
                                 f"e.g. --task_index=0")
    spec = ClusterSpec.from_hosts(values.get("ps_hosts"), values["worker_hosts"], origin="--")
    task = TaskId(job_name, index)
    spec.check_task(task, type_field="--job_name", index_field="--task_index")
    return spec, task, rest
