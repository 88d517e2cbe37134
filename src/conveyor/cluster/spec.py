"""The cluster description: which task runs where, and TensorFlow's TF_CONFIG for it.

A cluster has TensorFlow's four jobs, ``chief``, ``worker``, ``ps`` and ``evaluator``, and the data service's
``dispatcher`` and ``data_worker`` (``conveyor run --data-workers K``). Each is an
ordered tuple of ``"host:port"`` addresses; a task is a job name plus an index into that tuple::

    >>> spec = ClusterSpec.from_hosts(ps_hosts="h9:2222", worker_hosts="h1:2222,h2:2222")
    >>> spec.to_tf_config("worker", 1)
    '{"cluster": {"worker": ["h1:2222", "h2:2222"], "ps": ["h9:2222"]}, "task": {"type": "worker", "index": 1}}'
    >>> spec.rank_of(TaskId("worker", 1)), spec.world_size
    (1, 2)

Why TF_CONFIG: it is the one cluster format that Kubeflow's TFJob, Vertex/AI Platform and TensorFlow's
own strategies all speak, so a job described here can be started by those tools and a job they start
can be read here. Everything in this module is validated once, when it is built (STYLE habit 4), so
the launcher and the trainer can trust a ``ClusterSpec`` without re-checking it; every error names the
field that is wrong (``TF_CONFIG.cluster.worker[2]``) and shows what it should look like (habit 3).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import re
import reprlib
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConveyorError

__all__ = [
    "DATA_JOBS",
    "JOBS",
    "TRAINING_JOBS",
    "ClusterConfigError",
    "ClusterSpec",
    "TaskId",
    "join_address",
    "parse_tf_config",
    "split_address",
]

#: Job names in the order TF_CONFIG lists them and ranks are counted.
JOBS: tuple[str, ...] = ("chief", "worker", "ps", "evaluator", "dispatcher", "data_worker")
#: The data service's jobs (docs/data-service.md): they serve the input pipeline and never train.
DATA_JOBS: tuple[str, ...] = ("dispatcher", "data_worker")
#: Jobs whose tasks train (hold a rank in the torch process group). ps serves variables; the evaluator
#: watches checkpoints from outside the training group, as in TensorFlow.
TRAINING_JOBS: tuple[str, ...] = ("chief", "worker")

TF_CONFIG_EXAMPLE = (
    '{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"], "ps": ["host3:2222"]}, '
    '"task": {"type": "worker", "index": 0}}'
)
ADDRESS_EXAMPLE = '"host:port", e.g. "10.0.0.5:2222", "node01:2222" or "[::1]:2222"'

#: Bounds on outside input, each far above any real cluster and far below what would hurt to process.
#: An environment variable holds at most 128 KiB on Linux (MAX_ARG_STRLEN), so a longer TF_CONFIG is not
#: a real one; TensorFlow's nests 3 levels deep, and json.loads recurses once per level (a deep enough
#: document exhausts the stack), so depth is measured before decoding.
MAX_TF_CONFIG_CHARS = 1 << 20
MAX_TF_CONFIG_DEPTH = 32
#: Task indices, ranks and world sizes are C ints in torch.distributed.
MAX_INDEX = 2**31 - 1
#: The longest DNS name (RFC 1035); also keeps a host list from expanding into gigabytes of names.
MAX_HOST_CHARS = 253

# A host is a name or IPv4 address without ':' (or a bracketed IPv6 literal); the port is ASCII digits.
# Slashes are refused so that "grpc://h:2222" is reported instead of read as host "grpc://h". The host
# found here is then checked by host_problem, which says precisely what is wrong with it.
_ADDRESS_RE = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*(?:%[\w.-]+)?)\]|(?P<host>[^\s:/\[\],]+)):(?P<port>[0-9]+)$",
    re.ASCII,
)
# Host names as resolvers take them (RFC 1123 letters, digits, '-' and '.', plus the '_' that container
# names use), or "*", the wildcard a server may bind.
_HOST_NAME_RE = re.compile(r"\*|[A-Za-z0-9_.-]+")
# What the C resolver may read as an IPv4 address: it takes "127.1", "127.0.0.01" and "0x7f.1" too.
_IPV4_LIKE_RE = re.compile(r"[0-9][0-9a-fA-FxX.]*")


class ClusterConfigError(ConveyorError, ValueError):
    """A cluster description (TF_CONFIG, flags, environment variables) is wrong.

    A ``ValueError`` so that callers which treat bad input generically (the ``conveyor`` command exits
    with status 2 on one) need not know this layer. The message names the field and the expected shape.
    """

    usage_error = True  # a restart meets it again: `conveyor run` does not retry it


class _ShortRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlist, self.maxdict = 4, 80, 80, 8, 8

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int over 4300 digits raises ValueError (Python's int-string limit)
        return super().repr_int(x, level) if x.bit_length() <= 64 else f"<a {x.bit_length()}-bit integer>"


def show(value: object) -> str:
    """``repr(value)`` cut to a readable length, for error messages that echo outside input.

    The input may be a megabyte long or full of control characters; the message must stay one short,
    printable line (repr escapes what is not printable).
    """
    return _ShortRepr().repr(value)


def parse_decimal(text: str, maximum: int) -> int | None:
    """ASCII digits → their value; ``None`` if ``text`` is not all digits or the value is above ``maximum``.

    The length is checked before ``int()``, which refuses over 4300 digits with a plain ValueError.
    """
    if not (isinstance(text, str) and text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(maximum)):
        return None
    value = int(digits)
    return value if value <= maximum else None


def host_problem(host: str, *, allow_ipv6: bool = True) -> str | None:
    """What is wrong with ``host`` as a host name, IPv4 or (unbracketed) IPv6 address; ``None`` if nothing."""
    if not host:
        return "it is empty"
    if len(host) > MAX_HOST_CHARS:
        return f"the host is longer than {MAX_HOST_CHARS} characters"
    if allow_ipv6 and ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"the host {show(host)} is not an IPv6 address"
        return None
    if not _HOST_NAME_RE.fullmatch(host):
        return (f"the host {show(host)} has a character that is not allowed (a host name is ASCII letters, digits, "
                f"'-', '.' and '_')")
    return None


def parse_host(text: str, field: str, fix: str) -> str:
    """A host given alone, as ``MASTER_ADDR`` gives it: a name, an IPv4 address or an IPv6 literal.

    The IPv6 literal may be bracketed or not (torch takes it bare); it comes back bare, stripped of spaces.
    """
    host = text.strip() if isinstance(text, str) else ""
    if host.startswith("[") and host.endswith("]") and ":" in host:
        host = host[1:-1]
    problem = host_problem(host)
    if problem:
        raise ClusterConfigError(f"{field} = {show(text)} is not a host: {problem}; {fix}")
    return host


def split_address(address: str, field: str = "address") -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)``; IPv6 literals come back without brackets (``"[::1]:22"`` → ``("::1", 22)``).

    Bare hosts are what torch's ``MASTER_ADDR`` and socket calls expect, so callers get them unbracketed;
    :func:`join_address` puts the brackets back. ``field`` names the value in the error message.
    """
    if not isinstance(address, str):
        raise ClusterConfigError(f"{field} must be a string {ADDRESS_EXAMPLE}; got {show(address)}")
    text = address.strip()
    m = _ADDRESS_RE.match(text)
    host = None if m is None else m.group("v6") if m.group("v6") is not None else m.group("host")
    problem = _why_not_address(text) if m is None else host_problem(host)
    if problem:
        raise ClusterConfigError(f"{field} = {show(address)} is not an address: {problem}; "
                                 f"expected {ADDRESS_EXAMPLE}")
    port = parse_decimal(m.group("port"), 65535)
    if not port:
        digits = m.group("port").lstrip("0") or "0"
        which = f"port {digits}" if len(digits) <= 10 else "the port"
        raise ClusterConfigError(f"{field} = {show(address)}: {which} is out of range 1-65535; "
                                 f"expected {ADDRESS_EXAMPLE}")
    return host, port


def _why_not_address(text: str) -> str:
    """The most likely mistake in a string that failed the address pattern, for the error message."""
    if not text:
        return "it is empty"
    if "://" in text:
        return "drop the scheme (conveyor adds the protocol itself)"
    if text.count(":") > 1 and not text.startswith("["):
        return "an IPv6 host must be in brackets"
    host, sep, port = text.rpartition(":")
    if not sep:
        return "the port is missing"
    if not host or host == "[]":
        return "the host is empty"
    if not port:
        return "the port is empty"
    if not port.isascii() or not port.isdigit():
        return f"the port {show(port)} is not a number"
    return f"the host {show(host)} has a character that is not allowed (whitespace, '/', ',', brackets)"


def join_address(host: str, port: int) -> str:
    """``(host, port)`` → ``"host:port"``, bracketing IPv6 literals so the result parses back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _socket_key(address: str) -> tuple[str, int]:
    """The socket an address names, so that two spellings of one socket compare equal. Offline: no DNS.

    Host names are case-insensitive (RFC 4343) and a trailing dot only anchors them at the root; IP
    literals compare as addresses (``[::1]`` is ``[0:0:0:0:0:0:0:1]``, ``::ffff:127.0.0.1`` is IPv4's
    127.0.0.1, and ``127.0.0.01`` and ``127.1`` are 127.0.0.1 to the C resolver); ``localhost`` and the names
    under ``.localhost`` (RFC 6761) are 127.0.0.1, the address conveyor binds for them (IPv4 first), so
    ``[::1]:P`` and ``127.0.0.1:P`` stay two sockets.
    """
    host, port = split_address(address)
    if ":" in host:
        ip = ipaddress.IPv6Address(host)  # split_address has checked it parses
        return str(ip.ipv4_mapped or ip), port
    if _IPV4_LIKE_RE.fullmatch(host):
        try:
            return socket.inet_ntoa(socket.inet_aton(host)), port  # parses only, never looks anything up
        except OSError:
            pass  # not an address after all ("1e100"): a name
    name = host.lower().removesuffix(".") or host
    if name == "localhost" or name.endswith(".localhost"):
        return "127.0.0.1", port
    return name, port


@dataclass(frozen=True)
class TaskId:
    """One task's identity: its job (``type``, TensorFlow's word) and its index within that job.

    ``str(task)`` is ``"worker:1"``, the prefix the launcher puts on the task's log lines.
    """

    type: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.type not in JOBS:
            raise ClusterConfigError(f"TaskId.type = {show(self.type)} is not a job; expected one of {_names(JOBS)}")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or not 0 <= self.index <= MAX_INDEX:
            raise ClusterConfigError(f"TaskId.index = {show(self.index)}; expected an integer 0..{MAX_INDEX}")

    @property
    def is_training(self) -> bool:
        """True for chief and workers: the tasks that hold a rank in the training process group."""
        return self.type in TRAINING_JOBS

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


def _names(items: Sequence[str]) -> str:
    return ", ".join(f'"{x}"' for x in items)


def _validated_jobs(jobs: Mapping[str, Any], name_of: Callable[[str], str]) -> dict[str, tuple[str, ...]]:
    """Check a job → addresses mapping; return it with tuples, or raise naming the bad field.

    ``name_of(job)`` is how the caller's format names a job's field (``TF_CONFIG.cluster.worker``,
    ``--worker_hosts``), so one checker serves every source with messages in the source's own terms.
    """
    out: dict[str, tuple[str, ...]] = {}
    for job, addresses in jobs.items():
        if job not in JOBS:
            hint = " ('master' is TensorFlow 1's old name for 'chief')" if job == "master" else ""
            plain = isinstance(job, str) and job.isprintable() and len(job) <= 40  # else not pasted into a name
            raise ClusterConfigError(f"{name_of(job if plain else '<key>')}: unknown job {show(job)}{hint}; the "
                                     f"jobs are {_names(JOBS)}, each a list of addresses, e.g. {TF_CONFIG_EXAMPLE}")
        if isinstance(addresses, Mapping):
            raise ClusterConfigError(f"{name_of(job)} is a mapping of index to address; conveyor needs the dense "
                                     f'form, a list of addresses, e.g. "{job}": ["host1:2222", "host2:2222"]')
        if isinstance(addresses, (str, bytes)) or not isinstance(addresses, Sequence):
            raise ClusterConfigError(f"{name_of(job)} = {show(addresses)} is not a list of addresses; "
                                     f'expected e.g. "{job}": ["host1:2222", "host2:2222"]')
        for i, address in enumerate(addresses):
            split_address(address, f"{name_of(job)}[{i}]")
        out[job] = tuple(a.strip() for a in addresses)
    _check_no_duplicates(out, name_of)
    roles = {"chief": "it is rank 0", "evaluator": "it evaluates checkpoints outside the training group",
             "dispatcher": "it hands the data service's splits out"}
    for job, role in roles.items():
        if len(out.get(job, ())) > 1:
            raise ClusterConfigError(f"{name_of(job)} has {len(out[job])} addresses; there is at most one {job} "
                                     f'({role}). Keep one, e.g. "{job}": ["{out[job][0]}"], and '
                                     + ("drop the others" if job == "dispatcher" else 'move the others to "worker"'))
    return out


def _check_no_duplicates(jobs: Mapping[str, Sequence[str]], name_of: Callable[[str], str]) -> None:
    """Raise naming both entries when two addresses are one socket, however they are spelled."""
    seen: dict[tuple[str, int], tuple[str, str]] = {}
    for job in JOBS:
        for i, address in enumerate(jobs.get(job, ())):
            key, field = _socket_key(address), f"{name_of(job)}[{i}]"
            if key in seen:
                other_field, other = seen[key]
                same = "" if other == address else f" (both are {join_address(*key)})"
                raise ClusterConfigError(f"{field} = {show(address)} is also {other_field} = {show(other)}{same}: "
                                         f"every task needs its own host:port; give one of them another port")
            seen[key] = field, address


@dataclass(frozen=True)
class ClusterSpec:
    """Every task of a job and its address, by job: TensorFlow's ``tf.train.ClusterSpec`` as frozen data.

    Ranks: the training tasks are the chief and the workers. The chief, when there is one, is rank 0 and
    the workers follow in order (worker i is rank i + 1); without a chief, worker 0 is rank 0. This is
    the order TensorFlow's MultiWorkerMirroredStrategy uses (``multi_worker_util.id_in_cluster``) and
    the one Kubeflow's TFJob relies on, so rank 0 - the task that writes checkpoints and summaries - is
    the task those tools call the chief. ps and evaluator tasks have no rank.

    Built directly (``ClusterSpec(worker=("h1:2222", "h2:2222"))``), from TF_CONFIG, from classic
    ``--ps_hosts/--worker_hosts`` strings, or by the helpers in :mod:`conveyor.cluster.env`; each way is
    validated: addresses are ``host:port`` with a port in 1-65535, no socket appears twice however it is
    spelled (``localhost:P`` is ``127.0.0.1:P``; see :func:`_socket_key`), at most one
    chief and one evaluator, at least one task.
    """

    chief: tuple[str, ...] = ()
    worker: tuple[str, ...] = ()
    ps: tuple[str, ...] = ()
    evaluator: tuple[str, ...] = ()
    dispatcher: tuple[str, ...] = ()
    data_worker: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        jobs = _validated_jobs({job: getattr(self, job) for job in JOBS}, lambda job: f"ClusterSpec.{job}")
        for job, addresses in jobs.items():
            object.__setattr__(self, job, addresses)  # lists given by the caller become tuples: hashable, frozen
        if not any(jobs.values()):
            raise ClusterConfigError(f"a ClusterSpec needs at least one task; e.g. {TF_CONFIG_EXAMPLE}")

    # -- building ---------------------------------------------------------------------------------

    @classmethod
    def from_tf_config(cls, tf_config: str | Mapping[str, Any]) -> ClusterSpec:
        """The cluster part of a TF_CONFIG (the JSON string, or it already decoded).

        The ``task`` part is ignored here; :func:`parse_tf_config` reads both. Keys TensorFlow or cloud
        platforms add beside ``cluster`` (``rpc_layer``, ``environment``, ``job``...) are ignored too.
        """
        return _cluster_of(_load_tf_config(tf_config))

    @classmethod
    def from_hosts(
        cls,
        ps_hosts: str | Sequence[str] | None = None,
        worker_hosts: str | Sequence[str] | None = None,
        chief_hosts: str | Sequence[str] | None = None,
        *,
        origin: str = "",
    ) -> ClusterSpec:
        """A cluster from comma-separated address lists, as TensorFlow 1's ``--ps_hosts/--worker_hosts`` gave.

        ``ps_hosts="ps0:2222,ps1:2222"``; a list of strings works too; ``None`` or ``""`` is an empty job.
        ``origin`` is put before the field names in errors (``"--"`` makes them ``--worker_hosts[1]``) so
        that a message points at what the user typed.
        """
        given = {"chief": chief_hosts, "worker": worker_hosts, "ps": ps_hosts}
        jobs: dict[str, list[str]] = {}
        for job, hosts in given.items():
            field = f"{origin}{job}_hosts"
            if hosts is None:
                continue
            if isinstance(hosts, str):
                items = [h.strip() for h in hosts.split(",")] if hosts.strip() else []
            elif isinstance(hosts, Sequence) and not isinstance(hosts, bytes):
                items = list(hosts)
            else:
                raise ClusterConfigError(f'{field} = {show(hosts)}; expected a comma-separated string such as '
                                         f'"host1:2222,host2:2222" or a list of such addresses')
            for i, item in enumerate(items):
                if isinstance(item, str) and not item.strip():
                    raise ClusterConfigError(f"{field}[{i}] is empty ({show(hosts)} has a stray comma); expected "
                                             f'"host1:2222,host2:2222"')
            jobs[job] = items
        checked = _validated_jobs(jobs, lambda job: f"{origin}{job}_hosts")
        if not any(checked.values()):
            raise ClusterConfigError(f'{origin}worker_hosts is empty; expected e.g. "host1:2222,host2:2222"')
        return cls(**checked)

    # -- reading ----------------------------------------------------------------------------------

    @property
    def jobs(self) -> tuple[str, ...]:
        """The jobs that have tasks, in TF_CONFIG order (chief, worker, ps, evaluator)."""
        return tuple(job for job in JOBS if getattr(self, job))

    def num_tasks(self, job: str) -> int:
        """How many tasks ``job`` has (0 for a known job the cluster lacks, where TF would raise)."""
        return len(self._addresses(job))

    def task_address(self, task_type: str, index: int) -> str:
        """The ``host:port`` of one task; raises naming the valid range when it does not exist."""
        self.check_task(TaskId(task_type, index))
        return self._addresses(task_type)[index]

    @property
    def tasks(self) -> tuple[TaskId, ...]:
        """Every task, job by job in TF_CONFIG order: what a launcher starts."""
        return tuple(TaskId(job, i) for job in JOBS for i in range(len(getattr(self, job))))

    @property
    def training_tasks(self) -> tuple[TaskId, ...]:
        """The chief and workers in rank order: ``training_tasks[r]`` is the task of rank ``r``."""
        return tuple(t for t in self.tasks if t.is_training)

    @property
    def world_size(self) -> int:
        """The number of training tasks (chief + workers): torch's ``WORLD_SIZE``. ps tasks do not count."""
        return len(self.chief) + len(self.worker)

    def rank_of(self, task: TaskId) -> int:
        """The training rank of ``task``: chief 0, then workers in order (see the class docstring)."""
        self.check_task(task)
        if not task.is_training:
            raise ClusterConfigError(f"task {task} has no training rank: only chief and worker tasks train "
                                     f"(ranks 0..{self.world_size - 1})")
        return 0 if task.type == "chief" else len(self.chief) + task.index

    def check_task(self, task: TaskId, *, type_field: str = "task.type", index_field: str = "task.index") -> None:
        """Raise unless ``task`` is in this cluster; the fields are named as the caller's format names them.

        An evaluator may be absent from the cluster, as in TensorFlow, where the evaluator's TF_CONFIG lists
        the training cluster it watches but not itself; it is then ``evaluator:0``.
        """
        count = len(self._addresses(task.type))
        if task.type == "evaluator" and count == 0:
            count = 1
        if count == 0:
            raise ClusterConfigError(f"{type_field} = {task.type!r} but the cluster has no {task.type!r} job; "
                                     f"the cluster's jobs are {_names(self.jobs)}")
        if task.index >= count:
            raise ClusterConfigError(f"{index_field} = {task.index} is out of range: the cluster has {count} "
                                     f"{task.type!r} task{'s' if count > 1 else ''}, so the index is 0..{count - 1}")

    def as_dict(self) -> dict[str, list[str]]:
        """``{job: [addresses]}`` for the jobs that have tasks: TF_CONFIG's ``cluster`` value."""
        return {job: list(getattr(self, job)) for job in self.jobs}

    def to_tf_config(self, task_type: str, index: int) -> str:
        """TF_CONFIG for one task, in TensorFlow's exact JSON shape::

            {"cluster": {"chief": [...], "worker": [...], "ps": [...]}, "task": {"type": "worker", "index": 0}}

        Only jobs with tasks are listed. ``json.dumps``' default separators give the same text that
        TensorFlow's docs and Kubeflow emit, so the string can be compared and pasted as is.
        """
        task = TaskId(task_type, index)
        self.check_task(task)
        return json.dumps({"cluster": self.as_dict(), "task": {"type": task.type, "index": task.index}})

    def _addresses(self, job: str) -> tuple[str, ...]:
        if job not in JOBS:
            raise ClusterConfigError(f"unknown job {show(job)}; the jobs are {_names(JOBS)}")
        return getattr(self, job)


# -- TF_CONFIG -------------------------------------------------------------------------------------


def parse_tf_config(tf_config: str | Mapping[str, Any]) -> tuple[ClusterSpec, TaskId]:
    """Read a whole TF_CONFIG: the cluster and this process's task.

    Accepts what TensorFlow's ``TFConfigClusterResolver`` accepts: ``task.index`` may be a number or a
    string of digits (TF calls ``int()`` on it) and defaults to 0 when absent. The task must be in the
    cluster (an evaluator may be absent from it, as in TF). Text over :data:`MAX_TF_CONFIG_CHARS` or nested
    deeper than :data:`MAX_TF_CONFIG_DEPTH` is refused before it is decoded. Whatever is wrong raises
    :class:`ClusterConfigError` naming the field; nothing else escapes for any text.
    """
    doc = _load_tf_config(tf_config)
    spec = _cluster_of(doc)
    if "task" not in doc:
        raise ClusterConfigError(f'TF_CONFIG.task is missing: it says which task this process is, e.g. '
                                 f'"task": {{"type": "worker", "index": 0}} in {TF_CONFIG_EXAMPLE}')
    task_doc = doc["task"]
    if not isinstance(task_doc, Mapping):
        raise ClusterConfigError(f'TF_CONFIG.task = {show(task_doc)}; expected an object such as '
                                 f'{{"type": "worker", "index": 0}}')
    task_type = task_doc.get("type")
    if task_type not in JOBS:
        what = "is missing" if task_type is None else f"= {show(task_type)} is not a job"
        raise ClusterConfigError(f'TF_CONFIG.task.type {what}; expected one of {_names(JOBS)}, e.g. '
                                 f'{{"type": "worker", "index": 0}}')
    index = task_doc.get("index", 0)
    if isinstance(index, str) and (number := parse_decimal(index, MAX_INDEX)) is not None:
        index = number
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_INDEX:
        raise ClusterConfigError(f'TF_CONFIG.task.index = {show(index)}; expected an integer >= 0 (at most '
                                 f'{MAX_INDEX}), e.g. {{"type": "{task_type}", "index": 0}}')
    task = TaskId(task_type, index)
    spec.check_task(task, type_field="TF_CONFIG.task.type", index_field="TF_CONFIG.task.index")
    return spec, task


def _load_tf_config(tf_config: str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(tf_config, str):
        doc = _decode_json(tf_config)
    elif isinstance(tf_config, Mapping):
        doc = tf_config
    else:
        raise ClusterConfigError(f"TF_CONFIG must be a JSON string or a dict; got {type(tf_config).__name__}")
    if not isinstance(doc, Mapping):
        raise ClusterConfigError(f"TF_CONFIG is a JSON {type(doc).__name__}, not an object; expected "
                                 f"{TF_CONFIG_EXAMPLE}")
    return doc


class _LongNumber:
    """A JSON integer too long to be any count: kept as its length, since int() may refuse it (4300 digits)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<a {self.digits}-digit number>"


def _json_int(text: str) -> int | _LongNumber:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= 20 else _LongNumber(digits)


def _decode_json(text: str) -> Any:
    """``json.loads`` for TF_CONFIG, total: every failure is a ClusterConfigError that says where and why."""
    if len(text) > MAX_TF_CONFIG_CHARS:
        raise ClusterConfigError(f"TF_CONFIG is {len(text)} characters long; at most {MAX_TF_CONFIG_CHARS} are "
                                 f"read (a real one is a few hundred); expected e.g. {TF_CONFIG_EXAMPLE}")
    depth = _json_depth(text)
    if depth > MAX_TF_CONFIG_DEPTH:
        raise ClusterConfigError(f"TF_CONFIG nests {depth} levels deep; at most {MAX_TF_CONFIG_DEPTH} are read "
                                 f"(TensorFlow's needs 3); expected e.g. {TF_CONFIG_EXAMPLE}")
    try:
        return json.loads(text, parse_int=_json_int)
    except json.JSONDecodeError as e:
        raise ClusterConfigError(
            f"TF_CONFIG is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos}):\n"
            f"{_pointer(text, e.pos)}\nExpected a JSON object such as {TF_CONFIG_EXAMPLE}"
        ) from None


_JSON_ESCAPE_RE = re.compile(r"\\.", re.DOTALL)
_JSON_STRING_RE = re.compile(r'"[^"]*"')
_NOT_BRACKET_RE = re.compile(r"[^\[\]{}]+")


def _json_depth(text: str) -> int:
    """How deep ``[``/``{`` nest in ``text``, outside strings: an upper bound on json.loads' recursion.

    Linear and without recursion: escapes go first (so ``\\"`` does not end a string), then strings, then
    everything but brackets; the deepest running count of the rest is the depth. Up to where a document
    stops being valid JSON (where json.loads stops reading) this is exactly its nesting.
    """
    brackets = _NOT_BRACKET_RE.sub("", _JSON_STRING_RE.sub("", _JSON_ESCAPE_RE.sub("", text)))
    return max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def _pointer(text: str, pos: int, width: int = 30) -> str:
    """Two lines: the text around ``pos`` (what is not printable shown as spaces) and a caret under ``pos``."""
    start = max(0, pos - width)
    window = "".join(c if c.isprintable() else " " for c in text[start:pos + width])
    return f"  {window}\n  {' ' * (pos - start)}^"


def _cluster_of(doc: Mapping[str, Any]) -> ClusterSpec:
    if "cluster" not in doc:
        raise ClusterConfigError(f"TF_CONFIG.cluster is missing; expected e.g. {TF_CONFIG_EXAMPLE}")
    cluster = doc["cluster"]
    if not isinstance(cluster, Mapping):
        raise ClusterConfigError(f"TF_CONFIG.cluster = {show(cluster)} is not an object of job → addresses; "
                                 f"expected e.g. {TF_CONFIG_EXAMPLE}")
    jobs = _validated_jobs(cluster, lambda job: f"TF_CONFIG.cluster.{job}")
    if not any(jobs.values()):
        raise ClusterConfigError(f"TF_CONFIG.cluster has no tasks; expected e.g. {TF_CONFIG_EXAMPLE}")
    return ClusterSpec(**jobs)
