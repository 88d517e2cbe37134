"""The job handle: who this process is, which strategy it trains with, and a few byte-level collectives.

    import conveyor
    with conveyor.init() as job:              # python train.py, conveyor run, torchrun, mpirun, srun, TF_CONFIG
        model, optimizer = job.prepare(model, optimizer)
        states = job.all_gather_bytes(json.dumps(state).encode())   # one entry per rank, no pickle

``init()`` reads the task's identity with :func:`conveyor.cluster.discover` (every launcher's variables,
or none at all: a single local worker), picks the strategy, joins the process group when there is more
than one training process, and binds the strategy to the job. The same methods work with one process
and no process group, so a script runs unchanged under ``python train.py``.

The launcher's settings (``CONVEYOR_TIMEOUT``, ``CONVEYOR_RESTART_COUNT``, ``CONVEYOR_RESUME``,
``CONVEYOR_SHARE_GPUS``, the pipeline's, ...) are read once, into ``job.settings``
(:class:`conveyor.cluster.settings.JobSettings`); under torchrun ``TORCHELASTIC_USE_AGENT_STORE`` /
``TORCHELASTIC_RESTART_COUNT`` say that the agent hosts the rendezvous store.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor import exiting, recovery
from conveyor.cluster import Discovered, failure_report, validate
from conveyor.cluster.argv import discover_with_flags
from conveyor.cluster.output_lock import lock_for_script
from conveyor.cluster.settings import JobSettings
from conveyor.cluster.strategy_name import default_strategy, parse_strategy
from conveyor.cluster.variables import (
    OMP_DEFAULT_VAR,
    REJOIN_VAR,
    RESTART_COUNT_VAR,
    RESUME_VAR,
    TIMEOUT_VAR,
)
from conveyor.comm.gloo_interface import GLOO_IFNAME_VAR, interface_for
from conveyor.comm.mpi_rendezvous import agree_rendezvous
from conveyor.comm.process_group import collective_guard, init_process_group
from conveyor.strategies import Strategy, get_strategy
from conveyor.strategies.ps.task import serve_ps_task
from conveyor.train.checkpoint import CheckpointManager
from conveyor.train.devices import share_gpus_from, task_device

__all__ = ["DEFAULT_TIMEOUT", "RESTART_COUNT_VAR", "RESUME_VAR", "TIMEOUT_VAR", "Job", "init", "threads_per_worker"]

DEFAULT_TIMEOUT = 300.0

# A user's task runs the user's code: objects in reference cycles may still hold unwritten data at exit, so the
# quick exit (conveyor.exiting) is theirs to ask for; the test suite asks (a second of CPU per task).
if exiting.asked():
    exiting.install()

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def init(strategy: str | None = None, *, timeout: float | None = None, share_gpus: bool | None = None,
         environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> Job:
    """This process's :class:`Job`, its process group joined and its strategy set up.

    ``strategy``: the argument, else ``CONVEYOR_STRATEGY``, else ``"ps-sync"`` when the cluster has ps
    tasks, ``"allreduce"`` with several training processes and ``"local"`` with one. ``timeout``
    (seconds): the argument, else ``CONVEYOR_TIMEOUT``, else 300. The device: GPU ``local_rank`` of the
    visible ones, or the CPU without any (:mod:`conveyor.train.devices`); more training tasks on this
    machine than visible GPUs is an error unless ``share_gpus`` (the argument, else
    ``CONVEYOR_SHARE_GPUS=1``), which also makes the job's collectives use gloo. ``environ`` replaces ``os.environ``
    (tests, tools); nothing is written to it. ``argv`` (default ``sys.argv[1:]``) may hold TensorFlow 1's
    ``--ps_hosts/--worker_hosts/--job_name/--task_index``: where no launcher's variables describe this
    process, they do (``conveyor.cluster.argv``); they are read, not removed.

    On a parameter-server task (``ps`` in TF_CONFIG) this does not return: the task serves its share of
    the parameters (:mod:`conveyor.strategies.ps.task`) until every worker has said it is done, then
    the process exits with status 0 — TensorFlow's ``server.join()`` pattern, so one script serves every
    role (status 1, and why on stderr, when no worker was heard from for the timeout). Workers with a
    ``ps-*`` strategy still join the gloo process group among themselves (the ps tasks are not in it)
    for ``barrier``/``all_gather_bytes``/``all_reduce``.
    """
    recovery.mark("imports")  # the script has imported what it needs (the stall after a failure: conveyor.recovery)
    env: Mapping[str, str] = os.environ if environ is None else environ
    failure_report.install(env)  # under `conveyor run`: a fatal error tells the launcher what failed, the end too
    found = discover_with_flags(sys.argv[1:] if argv is None else argv, env)
    settings = JobSettings.from_environ(env)  # every setting the launcher gave, read and checked once
    if timeout is not None:
        settings = settings.replace(timeout=validate.timeout(timeout, "conveyor.init(timeout=...)"))
    if found.task.type == "ps":  # serves until the job ends, then the process exits: it never returns
        sys.exit(serve_ps_task(found, strategy, settings.timeout, checkpoints=CheckpointManager))
    if found.rank is None:
        raise NotImplementedError(f"this process is the {found.task} task, which has no training rank; only "
                                  f"chief and worker tasks can call conveyor.init() for now")
    num_ps = found.spec.num_tasks("ps") if found.spec is not None else 0
    # the argument, else the launcher's, else the default for the job's shape: parsed once, here
    parsed = parse_strategy(strategy or settings.strategy or default_strategy(found.world_size, num_ps))
    chosen = get_strategy(parsed.name)
    if found.world_size > 1 and not chosen.distributed:
        raise ValueError(f"strategy {chosen.name!r} trains in one process, but this job has {found.world_size} "
                         f"training processes (source: {found.source}), which would each train their own model; "
                         f"use 'allreduce', or run a single process")
    settings = settings.replace(strategy=parsed, share_gpus=share_gpus_from(share_gpus, env))
    output_dir = Path(settings.output_dir or "output")
    output_dir.mkdir(parents=True, exist_ok=True)
    output_lock = lock_for_script(found.rank, output_dir, env)  # one job per output folder (cluster/output_lock.py)
    device = task_device(found.local_rank, found.local_world_size, settings.share_gpus, env)
    _limit_threads(found.local_world_size, env)

    backend = "nccl" if device.type == "cuda" and not settings.share_gpus else "gloo"  # NCCL: one rank per GPU
    rejoining = _rejoining(env, parsed)
    owns_group = found.world_size > 1 and not rejoining and _join_group(found, backend, settings.timeout, env)
    recovery.mark("group")
    job = Job(found, chosen, settings, device=device, backend=backend, owns_group=owns_group, rejoining=rejoining)
    job._output_lock = output_lock
    try:
        chosen.setup(job)
    except BaseException:
        job.shutdown(wait_for_peers=False)
        raise
    return job


class Job:
    """One training process's view of the job; built by :func:`init`. See ``docs/training.md``.

    Attributes: ``rank``, ``world_size``, ``local_rank``, ``local_world_size``, ``is_chief``, ``task_type``,
    ``task_index``, ``cluster`` (``ClusterSpec`` or ``None``), ``strategy``, ``settings`` (the launcher's
    :class:`~conveyor.cluster.settings.JobSettings`, the strategy resolved), ``device``, ``data_dir``,
    ``output_dir``, ``restart_count``, ``resume``, ``timeout`` (seconds), ``backend``, ``data_shard``, ``source`` (which
    launcher's variables described this process), ``secret`` (the job's message-signing key, or ``None``;
    kept out of ``repr``). Strategies take their settings from ``settings``, never from ``os.environ``.
    """

    def __init__(self, found: Discovered, strategy: Strategy, settings: JobSettings, *, device: torch.device,
                 backend: str, owns_group: bool, rejoining: bool = False) -> None:
        self.rank: int = found.rank if found.rank is not None else 0
        self.world_size = found.world_size
        self.local_rank = found.local_rank
        self.local_world_size = found.local_world_size
        self.is_chief = self.rank == 0
        self.task_type = found.task.type
        self.task_index = found.task.index
        self.cluster = found.spec
        self.source = found.source
        self.strategy = strategy
        self.device = device
        self.backend = backend
        self.settings = settings
        self.data_dir = Path(settings.data_dir or "data")
        self.output_dir = Path(settings.output_dir or "output")
        self.restart_count = settings.restart_count
        self.resume = settings.resume
        self.timeout = settings.timeout
        self.secret = found.secret  # signs parameter-server messages (never printed: not in repr)
        self._owns_group = owns_group
        #: a ps-async/ssp worker restarted alone (CONVEYOR_REJOIN=1): it joined no process group
        self.rejoining = rejoining
        self._collectives: Any = None  # where the collectives go instead of the process group (use_collectives)
        self._output_lock = None  # rank 0's lock on output_dir when no launcher holds it; released by shutdown
        self._closed = False
        # nccl moves only CUDA tensors; gloo only CPU ones here. Byte collectives build their tensors there.
        self._comm_device = device if backend == "nccl" else torch.device("cpu")

    # -- training ---------------------------------------------------------------------------------

    def prepare(self, model: nn.Module, optimizer: Any, *, split: Sequence[str] | None = None
                ) -> tuple[nn.Module, Any]:
        """Wrap ``model`` and ``optimizer`` for the job's strategy; the rest of the loop is plain PyTorch.

        ``split``: the layers to cut the model before under ``--strategy pipeline`` (ignored by the
        data-parallel strategies, which hold the whole model), so one script runs under all of them.
        """
        self._check_open("prepare")
        return self.strategy.prepare(model, optimizer, split=split)

    @property
    def data_shard(self) -> tuple[int, int]:
        """(number of shards, this process's shard) for the training data: ``ds.shard(*job.data_shard)``.

        ``(world_size, rank)`` under data parallelism; under ``pipeline`` every stage of a replica reads the
        replica's shard, ``(replicas, replica)``.
        """
        return self.strategy.data_shard()

    def train_step(self, model: nn.Module, optimizer: Any, loss_fn: Any, inputs: Any, targets: Any) -> torch.Tensor:
        """One training step the strategy's way (zero_grad, forward, loss, backward, step; a pipeline's
        schedule over microbatches); returns the detached batch-mean loss. For plain loops that should
        run under every strategy, pipeline included."""
        self._check_open("train_step")
        return self.strategy.step.train(model, optimizer, loss_fn, inputs, targets, lambda phase: None)

    # -- collectives ------------------------------------------------------------------------------

    def barrier(self) -> None:
        """Wait until every rank gets here (a no-op with one process)."""
        self._check_open("barrier")
        if self._collectives is not None and self.world_size > 1:
            self._collectives.barrier()
        elif self.world_size > 1:
            with collective_guard(self, "barrier"):
                dist.barrier()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order. Lengths may differ; bytes travel as uint8 tensors (no pickle)."""
        self._check_open("all_gather_bytes")
        payload = _as_bytes(data, "all_gather_bytes(data)")
        if self.world_size == 1:
            return [payload]
        if self._collectives is not None:
            return self._collectives.all_gather_bytes(payload)
        with collective_guard(self, "all_gather_bytes"):
            # First the lengths, so every rank can pad its bytes to the longest: all_gather needs equal shapes.
            length = torch.tensor([len(payload)], dtype=torch.int64, device=self._comm_device)
            lengths = [torch.zeros_like(length) for _ in range(self.world_size)]
            dist.all_gather(lengths, length)
            sizes = [int(n.item()) for n in lengths]
            longest = max(sizes)
            if longest == 0:
                return [b""] * self.world_size
            mine = self._uint8(payload, longest)
            gathered = [torch.empty(longest, dtype=torch.uint8, device=self._comm_device) for _ in sizes]
            dist.all_gather(gathered, mine)
        return [t[:n].cpu().numpy().tobytes() for t, n in zip(gathered, sizes, strict=True)]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank ``src``'s ``data`` on every rank (other ranks may pass ``None``)."""
        self._check_open("broadcast_bytes")
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"broadcast_bytes(src={src!r}); expected a rank 0..{self.world_size - 1}")
        if self.rank == src:
            if data is None:
                raise ValueError(f"broadcast_bytes: rank {src} is the source and must pass bytes, not None")
            payload = _as_bytes(data, "broadcast_bytes(data)")
        else:
            payload = b""
        if self.world_size == 1:
            return payload
        if self._collectives is not None:
            return self._collectives.broadcast_bytes(payload, src)
        with collective_guard(self, "broadcast_bytes"):
            length = torch.tensor([len(payload)], dtype=torch.int64, device=self._comm_device)
            dist.broadcast(length, src=src)
            size = int(length.item())
            if size == 0:
                return b""
            buffer = self._uint8(payload, size) if self.rank == src else torch.empty(size, dtype=torch.uint8,
                                                                                       device=self._comm_device)
            dist.broadcast(buffer, src=src)
        return buffer.cpu().numpy().tobytes()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks in place and return it. ``op``: sum, mean, max, min, product."""
        self._check_open("all_reduce")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"all_reduce expects a torch.Tensor; got {type(tensor).__name__}")
        key = op.lower() if isinstance(op, str) else op
        if key not in (*_OPS, "mean"):
            raise ValueError(f"all_reduce(op={op!r}); expected one of 'sum', 'mean', 'max', 'min', 'product'")
        if self.world_size == 1:
            return tensor
        if self._collectives is not None:
            return self._collectives.all_reduce(tensor, key)
        work = tensor if tensor.device == self._comm_device else tensor.to(self._comm_device)
        with collective_guard(self, "all_reduce"):
            # gloo has no AVG: mean is a sum divided here (integer tensors get an integer quotient).
            dist.all_reduce(work, op=getattr(dist.ReduceOp, _OPS.get(key, "SUM")))
        if key == "mean":
            if work.is_floating_point() or work.is_complex():
                work.div_(self.world_size)
            else:
                work.floor_divide_(self.world_size)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def use_collectives(self, collectives: Any) -> None:
        """From now on, ``barrier``/``all_gather_bytes``/``broadcast_bytes``/``all_reduce`` go to ``collectives``
        instead of the process group (workers running apart meet on ps:0: ``strategies/ps/meetings.py``)."""
        self._collectives = collectives

    # -- lifetime ---------------------------------------------------------------------------------

    def shutdown(self, wait_for_peers: bool = True) -> None:
        """Shut the strategy down and leave the process group (idempotent).

        ``wait_for_peers`` (the normal end): first wait until every rank is shutting down too. Rank 0
        hosts the rendezvous store, and a rank whose peers tear the group down while it still uses
        it can abort at exit ("terminate called without an active exception", seen in 1 of 20 runs); an abort
        in finalization after the script's end is counted as finished by ``conveyor run`` (docs/launcher.md).
        A failing rank skips the wait (``with job:`` does on an exception), so it exits at once and
        the launcher sees it.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if wait_for_peers and self._collectives is not None and self.world_size > 1:
                self._meet_at_end()
            self.strategy.shutdown()
        finally:
            if self._owns_group and dist.is_initialized():
                if wait_for_peers and self.world_size > 1 and self._collectives is None:
                    try:
                        dist.barrier()
                    except Exception:  # noqa: BLE001 - a peer already gone: leave anyway
                        pass
                dist.destroy_process_group()
            if self._output_lock is not None:
                self._output_lock.release()

    def _meet_at_end(self) -> None:
        """Every worker is shutting down (the process group's barrier, where the workers meet elsewhere)."""
        try:
            self._collectives.barrier()
        except Exception:  # noqa: BLE001 - a peer already gone: leave anyway
            pass

    def __enter__(self) -> Job:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown(wait_for_peers=exc_type is None)

    def __repr__(self) -> str:
        return (f"Job(rank={self.rank}, world_size={self.world_size}, task={self.task_type}:{self.task_index}, "
                f"strategy={self.strategy.name!r}, device={self.device}, source={self.source!r})")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"job.{what}() after job.shutdown(); call conveyor.init() again for a new job")

    def _uint8(self, payload: bytes, size: int) -> torch.Tensor:
        out = torch.zeros(size, dtype=torch.uint8, device=self._comm_device)
        if payload:  # torch.frombuffer refuses an empty buffer
            out[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._comm_device)
        return out


# -- helpers ---------------------------------------------------------------------------------------


def threads_per_worker(local_world_size: int, cores: int) -> int:
    """Intra-op threads for each of ``local_world_size`` training processes sharing ``cores`` cores."""
    return max(1, cores // max(1, local_world_size))


def _limit_threads(local_world_size: int, env: Mapping[str, str]) -> None:
    """Give each of this machine's training processes its share of the cores.

    PyTorch sizes its intra-op pool to every core of the machine in every process. With N workers on
    one machine that is N x cores threads fighting over the cores; each worker's matrix products then
    stall on the others' and steps get slower than with fewer threads (torchrun sets OMP_NUM_THREADS=1
    for the same reason). An explicit OMP_NUM_THREADS is the user's (or launcher's) choice and is kept,
    except the ``1`` that ``conveyor run`` sets by torchrun's rule for scripts that do not call this
    (marked by ``CONVEYOR_OMP_DEFAULT=1``): a training task here gets its share of the cores instead.
    """
    defaulted = env.get(OMP_DEFAULT_VAR) == "1"
    if not defaulted and (local_world_size <= 1 or env.get("OMP_NUM_THREADS")):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(threads_per_worker(local_world_size, cores))


def _rejoining(env: Mapping[str, str], strategy: Any) -> bool:
    """Whether this worker replaces one of a ps-async/ssp job, restarted alone (``CONVEYOR_REJOIN=1``): a gloo
    group takes no new member, so it joins none and meets the others on ps:0 (docs/ps.md)."""
    return env.get(REJOIN_VAR) == "1" and strategy.uses_ps and strategy.mode != "sync"


def _join_group(found: Discovered, backend: str, timeout: float, env: Mapping[str, str]) -> bool:
    """Join the default process group; False when one already exists (the script made it) and is reused."""
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (found.rank, found.world_size):
            raise RuntimeError(f"a torch.distributed process group already exists with rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, but the environment says rank {found.rank} of "
                               f"{found.world_size}; let conveyor.init() create the group")
        return False
    addr, port, listener = found.master_addr, found.master_port, None
    if found.source == "mpi" and (addr is None or port is None):  # mpirun names no meeting point: agree on one
        addr, port, listener = agree_rendezvous(found, timeout)
    if addr is None or port is None:  # discovery guarantees both for world > 1 under every other source
        raise RuntimeError(f"no rendezvous address for a job of {found.world_size}: set MASTER_ADDR and MASTER_PORT")
    # torchrun's agent may host the store itself on MASTER_PORT; the workers are then all clients, and
    # the keys of one restart attempt are kept apart from the previous attempt's.
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if backend == "gloo" and found.spec is not None and GLOO_IFNAME_VAR not in os.environ:
        # gloo reads it from the real environment; see comm/gloo_interface.py for the hostname trap it avoids
        interface = interface_for(found.spec, found.task)
        if interface is not None:
            os.environ[GLOO_IFNAME_VAR] = interface
    prefix = f"conveyor/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}" if agent_store else None
    init_process_group(backend, addr, port, found.rank, found.world_size, timeout,
                       host_store=False if agent_store else None, store_prefix=prefix, listener=listener)
    return True


def _as_bytes(data: Any, what: str) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"{what} must be bytes; got {type(data).__name__} (encode text first, e.g. json.dumps(x).encode())")
