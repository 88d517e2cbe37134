"""Data parallelism with parameter servers: ``ps-sync``, ``ps-async`` and ``ps-ssp:K``.

    conveyor run -n 2 --ps 2 --strategy ps-sync train.py      # the same script on every task
    job = conveyor.init()                 # on a ps task: serves until the workers are done, then exits
    model, optimizer = job.prepare(model, optimizer)          # workers: hooks installed, servers initialised
    loss_fn(model(x), y).backward()       # gradients leave for the servers as backward produces them
    optimizer.step()                      # commit the step, pull the new parameters into the model

The servers own the parameters and the optimizer; ``prepare`` returns the model unwrapped and a thin
:class:`PSOptimizer` (``step()``: finish the pushes, commit, pull; ``param_groups`` shared with the real
optimizer, whose ``zero_grad()`` it is). ``strategy.step.comm_seconds()`` and :meth:`PSStrategy.report`
report push, pull and wait-for-servers time, bytes and the servers' counters;
the checkpoint item ``optimizer`` has every ps task write its shard into the chief's checkpoint step.

Promises: ``ps-sync`` is numerically an all-reduce and returns from ``step()`` with the new parameters
in place; ``ps-async``/``ps-ssp:K`` let workers run apart (a pull waits while more than K steps ahead
of the slowest) and deliver the new parameters by the model's next forward or ``state_dict``. Weights
loaded into the model after ``prepare`` are overwritten by the next pull. How and why:
docs/ps.md, "The parameter-server strategy".
"""

from __future__ import annotations

import atexit
import json
import sys
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.cluster.strategy_name import PS_MODES, StrategyName
from conveyor.comm.process_group import collective_guard
from conveyor.fileio import atomic_write
from conveyor.strategies.base import Step, Strategy, check_optimizer
from conveyor.strategies.coordination import Coordinator, IndependentCoordinator, LockstepCoordinator
from conveyor.strategies.ps.client import PSClient
from conveyor.strategies.ps.meetings import ServerCollectives
from conveyor.strategies.ps.reshard import ReshardError, reshard
from conveyor.strategies.ps.server import ShardFiles
from conveyor.train.checkpoint.items import Item, Model, StepWrite
from conveyor.train.checkpoint.read import Checkpoint, ResumeError

__all__ = ["PSOptimizer", "PSStrategy", "staleness_summary"]

_STATE_FORMAT = "conveyor.ps.servers_state"


class PSStrategy(Strategy):
    """Parameter servers with the update rule ``mode`` (``"sync"``, ``"async"``, ``"ssp"`` with ``staleness``)."""

    def __init__(self, mode: str = "sync", staleness: int = 0) -> None:
        super().__init__()
        if mode not in PS_MODES:
            raise ValueError(f"mode = {mode!r}; expected 'sync', 'async' or 'ssp'")
        self.mode = mode
        self.staleness = int(staleness)
        self.client: PSClient | None = None
        #: async/ssp: step() only sends the pull, the next forward (or state_dict()) receives it.
        self.prefetch = mode != "sync"
        #: what :meth:`PSClient.rejoin` answered a worker restarted alone (its predecessor's newest applied position)
        self.rejoined: bytes | None = None

    @property
    def rejoining(self) -> bool:
        """Whether this worker replaces one that died, restarted alone (``CONVEYOR_REJOIN=1``, async/ssp only)."""
        return bool(getattr(self._job, "rejoining", False))

    @property
    def name(self) -> str:  # type: ignore[override]
        return StrategyName("ps", self.mode, self.staleness).name

    def setup(self, job: Any) -> None:
        super().setup(job)
        spec = job.cluster
        num_ps = spec.num_tasks("ps") if spec is not None else 0
        if not num_ps:
            raise ValueError(f"strategy {self.name!r} needs parameter servers, but this job has none: start it "
                             f"with `conveyor run --ps M ...` or list a 'ps' job in TF_CONFIG")
        secret = getattr(job, "secret", None)
        if not secret:
            raise ValueError(f"strategy {self.name!r} needs the job secret that signs the parameter-server "
                             f"messages (CONVEYOR_JOB_SECRET, set by `conveyor run`)")
        addresses = [spec.task_address("ps", i) for i in range(num_ps)]
        self.client = PSClient(addresses, secret, rank=job.rank, num_workers=job.world_size,
                               sender=f"{job.task_type}:{job.task_index}", timeout=job.timeout)
        self.step = _PSStep(self)
        if getattr(job, "rejoining", False):  # restarted alone: no process group; it meets the others on ps:0
            job.use_collectives(ServerCollectives(self.client, world_size=job.world_size, rank=job.rank))
        atexit.register(self.shutdown)

    def prepare(self, model: nn.Module, optimizer: Any, *, split: Sequence[str] | None = None
                ) -> tuple[nn.Module, Any]:
        check_optimizer(model, optimizer)
        if self.client is None:
            raise RuntimeError(f"strategy {self.name!r} is not set up: get it from conveyor.init()")
        if self.job.device.type != "cpu":
            raise ValueError("parameter-server strategies run on CPU workers for now; use 'allreduce' on GPUs")
        model = model.to(self.job.device)
        placement = self.client.connect(model, optimizer)
        if self.rejoining:  # where its predecessor's last applied step left it (the Trainer continues from there)
            self.rejoined = self.client.rejoin()
            print(f"worker {self.job.rank} rejoins the parameter servers after {self.client.step} of its steps",
                  flush=True)
        buffers = [b for b in model.buffers() if b.is_floating_point() or b.dtype in (torch.int64, torch.int32)]
        if self.job.world_size > 1 and buffers and not self.rejoining:
            # Buffers (BatchNorm statistics) are not on the servers: start every worker from rank 0's.
            with collective_guard(self.job, "buffer broadcast from rank 0"):
                for buffer in buffers:
                    dist.broadcast(buffer, src=0)
        if self.prefetch:
            # The pull sent by step() is collected when the parameters are next needed.
            client = self.client
            model.register_forward_pre_hook(lambda module, args: client.finish_pull())
            model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: client.finish_pull())
        if self.job.is_chief:
            print(placement.describe(), flush=True)
        return model, PSOptimizer(optimizer, self)

    def checkpoint_items(self, module: nn.Module, optimizer: Any) -> dict[str, Item]:
        """The model as the workers see it, and the optimizer as shards every ps task writes itself."""
        return {"model": Model(module), "optimizer": _ShardedOptimizer(self, optimizer)}

    def coordinator(self, job: Any) -> Coordinator:
        """``ps-sync`` (or a single worker) moves in lockstep; ``ps-async``/``ps-ssp`` workers run apart,
        counting their shared steps and leaving their data positions with ps:0."""
        if self.mode == "sync" or job.world_size == 1:
            return LockstepCoordinator(job)
        return IndependentCoordinator(job, _ServerBoard(self._client("training"), self))

    def _client(self, what: str) -> PSClient:
        if self.client is None:
            raise RuntimeError(f"{what} with strategy {self.name!r} before conveyor.init() set it up or after "
                               f"job.shutdown()")
        return self.client

    def report(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        """The chief's ``communication`` entry: :meth:`stats` (the other ranks add nothing)."""
        stats = self.stats() if self.job.is_chief else None
        return {"communication": stats} if stats else None

    def stats(self) -> dict[str, Any]:
        """Push/pull/wait seconds, bytes per server, and each server's counters (staleness, drops)."""
        client = self.client
        if client is None:
            return {}
        servers = [reply.to_header() for reply in client.stats()]
        staleness: Counter[int] = Counter()
        for s in servers:
            staleness.update({int(k): v for k, v in s["staleness"].items()})
        return {"strategy": self.name, "step": client.step,
                "push_seconds": client.seconds["push"], "pull_seconds": client.seconds["pull"],
                "wait_seconds": client.seconds["wait"],
                "staleness": {str(k): v for k, v in sorted(staleness.items())},
                "max_staleness": max(staleness) if staleness else 0,
                "bytes_out_per_server": list(client.bytes_out), "bytes_in_per_server": list(client.bytes_in),
                "servers": servers}

    def shutdown(self) -> None:
        """Tell the servers this worker is done (they exit when every worker is).

        The chief first prints the parameter-server breakdown (push / pull / wait-for-servers seconds,
        bytes per server, staleness as count and percentiles, drops) and writes all of it, the staleness
        histogram included, to ``<output_dir>/ps-stats.json`` (``summary.json`` has it too).
        """
        if self.client is None:
            return
        if self._job is not None and self._job.is_chief and self.client.placement is not None:
            try:
                self._print_stats(self.stats())
            except Exception as exc:  # noqa: BLE001 - a report must not stop the shutdown
                print(f"parameter servers: no statistics ({type(exc).__name__}: {exc})", flush=True)
        client, self.client = self.client, None
        # A worker dying of an uncaught exception (atexit runs after it is printed) is not done: its replacement
        # (restarted alone) takes its place, and the servers must not stop as if it had finished.
        client.close(done=getattr(sys, "last_value", None) is None)

    def _print_stats(self, stats: dict[str, Any]) -> None:
        load = ", ".join(f"ps:{i} {(o + n) / 2**20:.1f} MiB"
                         for i, (o, n) in enumerate(zip(stats["bytes_out_per_server"], stats["bytes_in_per_server"],
                                                        strict=True)))
        print(f"parameter servers ({self.name}, {stats['step']} steps): push {stats['push_seconds']:.2f} s, "
              f"pull {stats['pull_seconds']:.2f} s, wait for servers {stats['wait_seconds']:.2f} s; traffic per "
              f"server: {load}; staleness {staleness_summary(stats['staleness'])}; dropped messages "
              f"{[s['dropped'] for s in stats['servers']]}", flush=True)
        out = getattr(self._job, "output_dir", None)
        if out is not None:
            atomic_write(Path(out) / "ps-stats.json", json.dumps(stats, indent=1).encode())


def staleness_summary(histogram: dict[str, int]) -> str:
    """``{"0": 90, "3": 10}`` -> ``"n=100 p50=0 p90=0 p99=3 max=3"``: a log line's worth of a staleness histogram."""
    counts = sorted((int(k), int(v)) for k, v in histogram.items() if int(v) > 0)
    total = sum(v for _, v in counts)
    if not total:
        return "n=0"

    def percentile(q: float) -> int:  # nearest rank: the smallest staleness with at least q of the records
        need, seen = q * total, 0
        for value, count in counts:
            seen += count
            if seen >= need:
                return value
        return counts[-1][0]

    return f"n={total} p50={percentile(0.5)} p90={percentile(0.9)} p99={percentile(0.99)} max={counts[-1][0]}"


class _ServerBoard:
    """The :class:`~conveyor.strategies.coordination.ProgressBoard` of workers running apart: ps:0.

    The shared step count and the announced total travel with every commit (no extra request);
    data positions go to ps:0 only when a checkpoint is due. The position after each step's batch travels with
    that step's commit to every server (``track``): what a replacement of this worker resumes from (``rejoined``).
    """

    def __init__(self, client: PSClient, strategy: PSStrategy) -> None:
        self.client = client
        self.replacement = strategy.rejoining
        self._strategy = strategy

    def track(self, position: bytes) -> None:
        self.client.position = position  # sent with the next commit when it changed

    def rejoined(self) -> bytes | None:
        return self._strategy.rejoined

    def global_progress(self) -> tuple[int, int | None]:
        return self.client.global_steps, self.client.plan

    def announce_total(self, total: int) -> None:
        self.client.announce = int(total)  # sent with the next commit

    def publish_position(self, data: bytes) -> None:
        self.client.publish_position(data)

    def positions(self) -> list[bytes | None]:
        return self.client.positions()


class _PSStep(Step):
    """The plain step; the optimizer's ``step()`` (:class:`PSOptimizer`) does the communication it counts."""

    shadows = True  # ps-sync: zero gradients in the servers' mean over all workers (workers running apart never wait)

    def __init__(self, strategy: PSStrategy) -> None:
        self._strategy = strategy

    def comm_seconds(self) -> float:
        """Push + pull + wait-for-servers seconds so far (0 once the job is shut down)."""
        client = self._strategy.client
        return 0.0 if client is None else float(sum(client.seconds.values()))

    def finish(self, module: nn.Module, job: Any) -> None:
        """Workers running apart (``ps-async``/``ps-ssp``): the pull sent by a worker's last ``step()`` may have
        been answered before another worker's last commit, so after a barrier (every ``step()`` returned with
        its commit applied: nothing changes on the servers any more) every worker pulls again. The final
        evaluation, the final checkpoint's ``model`` and the model after ``fit()`` are then the servers' final
        state, the one the checkpoint's shards (and an export of them) hold."""
        client = self._strategy.client
        if client is None or not self._strategy.prefetch or int(job.world_size) == 1:
            return  # ps-sync: step() returned with every worker's last step in place
        # From here the workers meet on ps:0, numbering their meetings from 0: a worker restarted alone is in no
        # process group, and took part in no collective so far (strategies/ps/meetings.py).
        job.use_collectives(ServerCollectives(client, world_size=job.world_size, rank=job.rank))
        job.barrier()
        client.finish_pull()  # the pull in flight, possibly stale, is collected first (one per connection)
        client.pull()


class PSOptimizer(torch.optim.Optimizer):
    """What ``job.prepare`` returns for the optimizer: the servers update; ``step()`` commits and pulls.

    A ``torch.optim.Optimizer`` (so LR schedulers accept it) that shares ``param_groups``, ``defaults``
    and ``state`` with the optimizer passed to ``prepare``: a scheduler's change to a group's ``lr`` (or
    any hyperparameter) is sent to the servers with the next step's commit. Its own torch ``step`` never
    runs. ``add_param_group`` is not supported (the servers' placement is fixed at ``prepare``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: PSStrategy) -> None:
        # Not Optimizer.__init__: that would build new param groups; these are the user's optimizer's.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._strategy = strategy

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        client = self._strategy.client
        if client is None:
            raise RuntimeError("optimizer.step() after the job was shut down")
        client.finish_step(prefetch=self._strategy.prefetch)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add_param_group() with parameter servers: the servers' placement is fixed when "
                                  "job.prepare() runs; build the optimizer with every group first")

    def state_dict(self) -> dict[str, Any]:
        """The servers' pieces and optimizer state, fetched now: ``{"format", "servers": [{"meta", "tensors"}]}``.

        ``meta`` is JSON, ``tensors`` a flat ``{name: tensor}`` dict (no pickle: the trainer's checkpoints
        put the tensors in safetensors and the rest in JSON).
        """
        client = self._strategy.client
        if client is None:
            raise RuntimeError("optimizer.state_dict() after the job was shut down")
        servers = [{"meta": reply.meta, "tensors": reply.named} for reply in client.state()]
        return {"format": _STATE_FORMAT, "servers": servers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Send what :meth:`state_dict` returned back to the servers, then pull the restored parameters; a state
        of another number of ps tasks is re-split over these first (:func:`.reshard.reshard`)."""
        client = self._strategy.client
        if client is None:
            raise RuntimeError("optimizer.load_state_dict() after the job was shut down")
        if "shards" in state:
            raise ValueError("this optimizer state names shards the ps tasks wrote into a checkpoint folder; "
                             "the item of job.strategy.checkpoint_items(model, optimizer) restores it "
                             "(the Trainer does this on resume)")
        if state.get("format") != _STATE_FORMAT or not state.get("servers"):
            raise ValueError("not a parameter-server optimizer state (a checkpoint of another strategy?)")
        servers = [(entry["meta"], entry["tensors"]) for entry in state["servers"]]
        if len(servers) != client.num_servers and client.placement is not None:  # another number of ps tasks
            servers = [(meta, tensors) for tensors, meta in reshard([(t, m) for m, t in servers], client.placement)]
        client.load_state(servers)
        client.pull()

    def __repr__(self) -> str:
        return f"PSOptimizer({type(self.optimizer).__name__}, strategy={self._strategy.name!r})"


class _ShardedOptimizer(Item):
    """The optimizer state of a ps job: every ps task writes its shard into the step; the chief's tree is a
    reference to them."""

    def __init__(self, strategy: PSStrategy, optimizer: Any):
        self.strategy, self.optimizer = strategy, optimizer

    def save(self, name: str, out: StepWrite) -> None:
        if not out.is_chief:
            return
        client = self.strategy._client("checkpoint")
        parts = client.save_shards(out.step, Path(out.root).resolve())  # the ps tasks may run in another folder
        out.tree(name, {"format": _STATE_FORMAT, "num_ps": client.num_servers, "shards": parts})
        out.expect(parts)

    def restore(self, name: str, ckpt: Checkpoint) -> None:
        """Rank 0 has every ps task load its shard of the step; then every worker pulls."""
        client, state = self.strategy._client("resume"), ckpt.tree(name)
        if not (isinstance(state, dict) and "shards" in state):
            self.optimizer.load_state_dict(state)  # a state fetched to the worker (PSOptimizer.state_dict)
            return
        saved = state.get("num_ps")
        if state.get("format") != _STATE_FORMAT or not isinstance(saved, int) or saved < 1:
            raise ValueError(f"checkpoint step {ckpt.step} holds no parameter-server shards it names (format "
                             f"{state.get('format')!r}, {saved!r} ps tasks): resume with the setup that wrote it or "
                             f"start over with --no-resume")
        if self.strategy.job.rank == 0:
            if saved == client.num_servers:
                client.restore_shards(ckpt.step, Path(ckpt.root).resolve())  # each ps task reads its own shard
            else:
                self._reshard(ckpt, saved, client)
        self.strategy.job.barrier()  # no worker pulls before every shard is back
        client.pull()

    def _reshard(self, ckpt: Checkpoint, saved: int, client: PSClient) -> None:
        """Rank 0 reads the `saved` servers' shards, re-splits them as this job's placement cuts the parameters
        and sends each server its share (`.reshard`; docs/ps.md, "Resuming on another number of ps tasks")."""
        parts = _StepParts(ckpt)
        shards = [ShardFiles(i, None).read(parts, ckpt.step) for i in range(saved)]
        assert client.placement is not None  # prepare() placed the parameters before any resume
        try:
            states = reshard(shards, client.placement)
        except ReshardError as e:
            raise ResumeError(f"checkpoint {ckpt.path} was written with {saved} ps tasks and cannot be re-split "
                              f"onto this job's {client.num_servers}: {e}") from e
        client.load_state([(meta, tensors) for tensors, meta in states])
        ckpt.reworld.append(("ps tasks", saved, client.num_servers, "shards",
                             f"{len(client.placement.pieces)} pieces, parameters and optimizer state as saved"))


class _StepParts:
    """One checkpoint step's parts as the `ShardStore` that `ShardFiles.read` reads (read only, checked)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt

    def read_part(self, step: int, name: str) -> bytes:
        return self.ckpt.read_part(name)

    def save_part(self, step: int, name: str, data: bytes) -> None:
        raise RuntimeError(f"checkpoint step {step} is sealed: {name} cannot be written into it")
