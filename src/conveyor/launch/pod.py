"""A pod's task, from the index Kubernetes gives it: what `conveyor k8s-task` does before it becomes the script.

    launch = pod_launch(os.environ, role="worker", cluster='{"worker": [...], "ps": [...]}', master_port=29500,
                        script="train.py", script_args=("--epochs", "1"))
    wait_for_hosts(launch.hosts, timeout=300)          # every pod's name resolves: the pods are up
    os.execvpe(launch.argv[0], launch.argv, launch.env)

Every pod of a role runs the same command (:mod:`conveyor.launch.k8s`), and ``JOB_COMPLETION_INDEX``, which
the Job controller sets in each pod of an Indexed Job, says which task of the role it is. From role, index
and cluster the pod gets what `conveyor run` gives a task (:func:`conveyor.cluster.task_environment`):
``TF_CONFIG``; ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (one task per pod),
``MASTER_ADDR`` (rank 0's pod, by its DNS name) and ``MASTER_PORT``; ``CONVEYOR_TASK_TYPE``/``_INDEX``.
The variables alike on every pod (strategy, folders, secret, restart count) come from the manifest's env.
``conveyor.init()`` then finds its task through the ``conveyor`` source, as under `conveyor run`, and a
plain torch or TensorFlow script reads the same variables.

A pod's DNS name resolves only once the pod runs, so the command first waits (bounded by the job's
timeout) until every pod of the job resolves; a name that never does is an error naming it, never a
fallback to another address. The pod's own hostname must be its task's: else the job was renamed.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from conveyor.cluster import ClusterSpec, TaskId, split_address, task_environment
from conveyor.cluster.settings import JobSettings
from conveyor.cluster.spec import ClusterConfigError, parse_decimal, show
from conveyor.cluster.variables import (
    DATA_DIR_VAR,
    JOB_SECRET_VAR,
    OUTPUT_DIR_VAR,
    STRATEGY_VAR,
    TASK_INDEX_VAR,
    TASK_TYPE_VAR,
    TIMEOUT_VAR,
)
from conveyor.errors import RendezvousError
from conveyor.launch.plan import TORCHRUN_VARS, tf_flags

__all__ = ["INDEX_VAR", "PodLaunch", "pod_launch", "timeout_of", "wait_for_hosts"]

#: Set by Kubernetes' Job controller in every pod of an Indexed Job: the pod's completion index.
INDEX_VAR = "JOB_COMPLETION_INDEX"
#: Identity variables a pod must not inherit from its image: the task's own replace them.
_IDENTITY = ("TF_CONFIG", TASK_TYPE_VAR, TASK_INDEX_VAR,
             *(v for v in TORCHRUN_VARS if v != "TORCH_NCCL_ASYNC_ERROR_HANDLING"))
_FROM_MANIFEST = "the manifests `conveyor k8s` writes set it in every pod"


@dataclass(frozen=True)
class PodLaunch:
    """What the pod runs: its task, the script's argv, its whole environment, every pod's host name."""

    task: TaskId
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    hosts: tuple[str, ...]
    spec: ClusterSpec


def pod_launch(environ: Mapping[str, str], *, role: str, cluster: str, master_port: int, script: str,
               script_args: Sequence[str] = (), python: str = sys.executable, use_tf_flags: bool = False,
               hostname: str | None = None) -> PodLaunch:
    """This pod's task and what to run, from ``environ`` (the pod's) and the command's flags.

    ``hostname`` (default: this machine's) must be the host of the task in ``cluster``.
    """
    spec = _cluster(cluster)
    task = TaskId(role, _index(environ))
    spec.check_task(task, type_field="--role", index_field=INDEX_VAR)
    host = split_address(spec.task_address(task.type, task.index))[0]
    hostname = socket.gethostname() if hostname is None else hostname
    if host.split(".")[0] != hostname:
        raise ClusterConfigError(f"this pod's hostname is {hostname!r}, but task {task} is {host} in --cluster: the "
                                 f"pods of an Indexed Job are named <job name>-<index>, so the Job (or JobSet) was "
                                 f"renamed after `conveyor k8s` wrote it; write the manifests again")
    rank0 = spec.training_tasks[0]
    master = split_address(spec.task_address(rank0.type, rank0.index))[0]
    base = {k: v for k, v in environ.items() if k not in _IDENTITY}
    own = task_environment(spec, task, secret=_secret(environ), data_dir=_require(environ, DATA_DIR_VAR),
                           output_dir=_require(environ, OUTPUT_DIR_VAR), master_addr=master,
                           master_port=master_port, strategy=_require(environ, STRATEGY_VAR))
    flags = tf_flags(spec, task) if use_tf_flags else ()
    hosts = tuple(dict.fromkeys(split_address(spec.task_address(t.type, t.index))[0] for t in spec.tasks))
    return PodLaunch(task, (python, script, *flags, *script_args), {**base, **own}, hosts, spec)


def wait_for_hosts(hosts: Sequence[str], timeout: float, *, note: Callable[[str], None] | None = None,
                   resolve: Callable[[str], object] = lambda host: socket.getaddrinfo(host, None),
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once every name in ``hosts`` resolves; :class:`RendezvousError` naming those that do not
    after ``timeout`` seconds. ``note`` hears, once, which names are still awaited after 10 s."""
    start = clock()
    waiting = list(hosts)
    noted = False
    while True:
        waiting = [host for host in waiting if not _resolves(host, resolve)]
        if not waiting:
            return
        elapsed = clock() - start
        shown = ", ".join(waiting[:5]) + (f" and {len(waiting) - 5} more" if len(waiting) > 5 else "")
        if elapsed >= timeout:
            raise RendezvousError(
                f"{len(waiting)} pod name(s) did not resolve within {timeout:g} s: {shown}. A pod's name resolves "
                f"once it runs and the job's headless Service exists: see `kubectl get pods,services`; pods "
                f"pending for resources hold up the job (raise the timeout with --timeout)")
        if note is not None and not noted and elapsed >= 10:
            note(f"waiting for {shown} to resolve (pods not running yet?)")
            noted = True
        sleep(min(0.5, max(0.0, timeout - elapsed)))


def _resolves(host: str, resolve: Callable[[str], object]) -> bool:
    try:
        resolve(host)
    except OSError:  # socket.gaierror: not (yet) in DNS
        return False
    return True


def _cluster(text: str) -> ClusterSpec:
    if not text.strip().startswith("{"):
        raise ClusterConfigError(f"--cluster {show(text)}: expected TF_CONFIG's cluster as JSON, such as "
                                 f'{{"worker": ["job-worker-0.job:2222"]}}')
    return ClusterSpec.from_tf_config('{"cluster": ' + text + "}")


def _index(environ: Mapping[str, str]) -> int:
    text = environ.get(INDEX_VAR, "").strip()
    if not text:
        raise ClusterConfigError(f"{INDEX_VAR} is not set: Kubernetes sets it in every pod of an Indexed Job "
                                 f"(completionMode: Indexed); conveyor k8s-task runs in the pods `conveyor k8s` "
                                 f"describes")
    index = parse_decimal(text, 2**31 - 1)
    if index is None:
        raise ClusterConfigError(f"{INDEX_VAR}={show(text)} is not a whole number >= 0")
    return index


def _require(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "").strip()
    if not value:
        raise ClusterConfigError(f"{name} is not set in this pod; {_FROM_MANIFEST}")
    return value


def _secret(environ: Mapping[str, str]) -> bytes:
    text = _require(environ, JOB_SECRET_VAR)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:  # the value is never echoed: it signs the job's messages
        raise ClusterConfigError(f"{JOB_SECRET_VAR} is not at least 32 hex digits; the job's Secret must hold "
                                 f"them, e.g. kubectl create secret generic NAME --from-literal=secret=$(openssl "
                                 f"rand -hex 32)")
    return secret


def timeout_of(environ: Mapping[str, str]) -> float:
    """The job's timeout (``CONVEYOR_TIMEOUT``, default 300), which also bounds the wait for the pods' names."""
    try:  # the job's settings' one reading of the variable; only this one is needed before the script starts
        return JobSettings.from_environ({TIMEOUT_VAR: environ.get(TIMEOUT_VAR, "")}).timeout
    except ValueError as e:
        raise ClusterConfigError(f"{e}; {_FROM_MANIFEST}") from None
