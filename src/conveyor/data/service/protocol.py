"""What the data service's three roles agree on: message kinds, the service address, element frames, errors.

    service = Service("10.0.0.5:5050", secret)        # or "10.0.0.5:5050" with CONVEYOR_JOB_SECRET(_FILE) set
    frames, counts = element_frames([e0, e1])          # uint8 arrays: per element a header and its buffers
    [(e0, n0), (e1, n1)] == elements_from_frames(message.tensors, counts)     # n: an element's bytes

Every message is a :mod:`conveyor.comm.framing` message over :mod:`conveyor.comm.transport` (signed with the
job secret, no pickle). The dispatcher's task name is ``data-dispatcher``, every worker's ``data-worker``.
Requests to the dispatcher: ``register_worker``, ``heartbeat``, ``get_split``, ``split_done``,
``release_splits``, ``get_or_create_job``, ``get_workers``; to a worker: ``get_elements`` (answered with
``elements``, ``none`` or ``end``) and ``stats``. Processing modes are tf.data's: ``parallel_epochs``
(each worker runs the whole pipeline) and ``distributed_epoch`` (the dispatcher hands the files out one
at a time).
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from conveyor.cluster.secret import parse_secret
from conveyor.cluster.secret import read_secret_file as _read_file
from conveyor.cluster.spec import split_address
from conveyor.cluster.variables import DATA_SERVICE_VAR, JOB_SECRET_FILE_VAR, JOB_SECRET_VAR
from conveyor.data.elements import pack, unpack_parts
from conveyor.errors import ConveyorError

DISPATCHER = "data-dispatcher"
WORKER = "data-worker"
MODES = ("parallel_epochs", "distributed_epoch")
MAKE_SECRET = ("make one with `openssl rand -hex 32 > job.secret && chmod 600 job.secret` and give the same file "
               "to the dispatcher, every worker and the trainer (--secret-file, or CONVEYOR_JOB_SECRET_FILE)")


class DataServiceError(ConveyorError, RuntimeError):
    """A data-service problem: the message names the role, the address and the fix."""


class PipelineMismatchError(DataServiceError):
    """A worker (or a trainer's job) built a different pipeline from the one the dispatcher serves."""

    usage_error = True


@dataclass(frozen=True)
class Service:
    """Where the dispatcher listens and the job secret that signs every message."""

    address: str
    secret: bytes

    def __post_init__(self) -> None:
        split_address(self.address, field="data service dispatcher address")
        if len(self.secret) < 16:
            raise DataServiceError(f"the data service's secret must be at least 16 bytes; {MAKE_SECRET}")


def read_secret_text(text: str, where: str) -> bytes:
    """A hex secret (as `openssl rand -hex 32` writes it) from ``where``."""
    return parse_secret(text, where, error=DataServiceError, fix=MAKE_SECRET)


def read_secret_file(path: str, where: str = "--secret-file") -> bytes:
    return _read_file(path, where, error=DataServiceError, fix=MAKE_SECRET)


def resolve_service(service: Service | str, environ: Any = None) -> Service:
    """A :class:`Service` from itself or from ``"HOST:PORT"`` plus the job secret in the environment."""
    if isinstance(service, Service):
        return service
    if not isinstance(service, str):
        raise TypeError(f"service must be 'HOST:PORT' or a conveyor.data.service.Service, got {type(service).__name__}")
    env = os.environ if environ is None else environ
    if env.get(JOB_SECRET_FILE_VAR):
        secret = read_secret_file(env[JOB_SECRET_FILE_VAR], JOB_SECRET_FILE_VAR)
    elif env.get(JOB_SECRET_VAR):
        secret = read_secret_text(env[JOB_SECRET_VAR], JOB_SECRET_VAR)
    else:
        raise DataServiceError(f"the data service at {service} needs the job secret: pass Service({service!r}, "
                               f"secret) or set {JOB_SECRET_FILE_VAR}; {MAKE_SECRET}")
    return Service(service, secret)


def from_env(environ: Any = None) -> Service:
    """The job's data service as `conveyor run --data-workers K` tells every task: the dispatcher's address in
    ``CONVEYOR_DATA_SERVICE`` and the job secret (``CONVEYOR_JOB_SECRET``, or ``CONVEYOR_JOB_SECRET_FILE``)."""
    env = os.environ if environ is None else environ
    address = env.get(DATA_SERVICE_VAR)
    if not address:
        raise DataServiceError(f"{DATA_SERVICE_VAR} is not set: start the job with `conveyor run --data-workers K "
                               f"--data-pipeline MODULE:FUNCTION ...`, which starts the data service and sets it, or "
                               f"pass distribute() the dispatcher's address (`conveyor data serve`)")
    return resolve_service(address, env)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise DataServiceError(f"processing_mode must be one of {', '.join(MODES)} (tf.data's names), got {mode!r}")
    return mode


def element_frames(elements: list[Any]) -> tuple[list[np.ndarray], list[int]]:
    """Each element as uint8 frames, elements.py's ``pack``: its JSON header, then each of its buffers viewing
    the element's own memory (no copy: ZeroMQ sends them as they are); and how many frames each element has."""
    frames: list[np.ndarray] = []
    counts = []
    for element in elements:
        header, bufs = pack(element)
        parts = [np.frombuffer(header, dtype=np.uint8), *(np.frombuffer(b, dtype=np.uint8) for b in bufs)]
        frames.extend(parts)
        counts.append(len(parts))
    return frames, counts


def elements_from_frames(frames: list[np.ndarray], counts: list[int]) -> list[tuple[Any, int]]:
    """``(element, its bytes)`` per element, the arrays viewing the received frames (no copy; an array that
    its frame's address leaves misaligned is copied)."""
    if sum(counts) != len(frames) or min(counts, default=1) < 1:
        raise DataServiceError(f"a data worker's reply has {len(frames)} frames for elements of {counts} frames: "
                               f"the data workers run another conveyor version than this trainer?")
    out, at = [], 0
    for n in counts:
        mine = frames[at:at + n]
        out.append((unpack_parts(mine[0], [memoryview(f).cast("B") for f in mine[1:]], copy=False),
                    sum(f.nbytes for f in mine)))
        at += n
    return out


def put_until_stopped(into: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` into a bounded queue, waiting while it is full; False (not put) once ``stop`` is set."""
    while not stop.is_set():
        try:
            into.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False
