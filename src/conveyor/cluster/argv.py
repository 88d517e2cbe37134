"""This process's identity from TensorFlow 1's cluster flags on its own command line (``conveyor.init()``).

A TensorFlow 1 trainer is started once per task, by hand or by a script, each time with the cluster on
its command line::

    python trainer.py --ps_hosts=h9:2222 --worker_hosts=h1:2222,h2:2222 --job_name=worker --task_index=1

:func:`discover_with_flags` reads those flags (``--flag=value`` or ``--flag value``) when they are there,
so that N such tasks become one job rather than N single-process ones; the environment's launcher
variables (:func:`~conveyor.cluster.discover.discover`) still come first, and must then agree with the
flags (``conveyor run --tf-flags`` gives both). Pure: ``argv`` and ``environ`` are parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from conveyor.cluster.discover import Discovered, discover
from conveyor.cluster.flags import CLUSTER_FLAGS, parse_cluster_flags
from conveyor.cluster.spec import ClusterConfigError, ClusterSpec, TaskId

__all__ = ["FLAGS_SOURCE", "cluster_flags_in", "discover_with_flags"]

#: ``Discovered.source`` of a task described by its command-line flags alone.
FLAGS_SOURCE = "tf_flags"
_REQUIRED = ("worker_hosts", "job_name", "task_index")
_EXAMPLE = "--ps_hosts=h9:2222 --worker_hosts=h1:2222,h2:2222 --job_name=worker --task_index=1"


def cluster_flags_in(argv: Sequence[str]) -> tuple[ClusterSpec, TaskId] | None:
    """``(cluster, task)`` from TensorFlow 1's flags in ``argv`` (without the program name), or ``None``
    when none of the four is there. A partial set is refused, naming what is missing: a task that guessed
    its index would silently train as another task's twin. ``--ps_hosts`` may be absent or empty (no ps).
    """
    given = _flags_given(argv)
    if not given:
        return None
    missing = [f"--{name}" for name in _REQUIRED if name not in given]
    if missing:
        have = ", ".join(f"--{name}" for name in CLUSTER_FLAGS if name in given)
        raise ClusterConfigError(f"the command line has {have} but not {', '.join(missing)}: a task started with "
                                 f"TensorFlow 1's cluster flags needs --worker_hosts, --job_name and --task_index "
                                 f"(and --ps_hosts with parameter servers), e.g. {_EXAMPLE}; give the missing "
                                 f"ones, or none of the four")
    parsed = parse_cluster_flags(argv)
    assert parsed is not None  # a flag was given
    spec, task, _ = parsed
    return spec, task


def discover_with_flags(argv: Sequence[str], environ: Mapping[str, str]) -> Discovered:
    """:func:`discover` from ``environ``, or, where no launcher described this process, from ``argv``'s
    TensorFlow 1 flags (as TF_CONFIG would: rank 0's address is the rendezvous point unless
    ``MASTER_ADDR``/``MASTER_PORT`` are set). Both given: they must name the same task and cluster."""
    flags = cluster_flags_in(argv)
    found = discover(environ)
    if flags is None:
        return found
    spec, task = flags
    if found.source != "single":
        if (found.task, found.spec) != (task, spec):
            theirs = found.spec.as_dict() if found.spec else f"a job of {found.world_size}"
            raise ClusterConfigError(f"the command line's --job_name/--task_index/--ps_hosts/--worker_hosts make "
                                     f"this task {task} of {spec.as_dict()}, but the environment ({found.source}) "
                                     f"makes it {found.task} of {theirs}; start it with one of the two, or make "
                                     f"them agree")
        return found
    described = discover({**environ, "TF_CONFIG": spec.to_tf_config(task.type, task.index)})
    return dataclasses.replace(described, source=FLAGS_SOURCE)


def _flags_given(argv: Sequence[str]) -> set[str]:
    given: set[str] = set()
    for arg in argv:
        if arg == "--":  # the rest belongs to someone else, as parse_cluster_flags reads it
            break
        name = arg[2:].partition("=")[0] if arg.startswith("--") else ""
        if name in CLUSTER_FLAGS:
            given.add(name)
    return given
