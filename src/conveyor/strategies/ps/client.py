"""The worker's side of the parameter servers: push gradients as backward makes them, pull parameters.

    client = PSClient(["127.0.0.1:2222", "127.0.0.1:2223"], secret, rank=0, num_workers=2, sender="worker:0")
    client.connect(model, optimizer)     # placement, init of every server, first pull, autograd hooks
    loss.backward()                      # gradients go into a bucket as backward makes them; a full one is pushed
    client.finish_step()                 # the rest of the bucket + commit to every server, then the pull

:class:`PSConnections` (the base) holds one transport client per ps task and asks the servers
everything outside a step (checkpoint shards, state, statistics, data positions); :class:`PSClient`
adds the step protocol of :mod:`.protocol`, keeping what lasts the run; what one step does is a
:class:`~.steps.StepState`, made when the step before is committed.

Promises: pulled values are copied into the model's parameters in place, so the model object stays
valid; a server that answers ``wait`` is asked again until the timeout; from construction to
:meth:`~PSConnections.close` every server is pinged every quarter of ``timeout`` (at most 5 s), so a
busy but live worker keeps its ps tasks up. Gradient accumulation over several backward calls per step
works with ``ps-sync`` only. How and why: docs/ps.md, "The parameter-server strategy".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.comm.transport import Client, ServerUnavailable, TransportError
from conveyor.strategies.ps import protocol as wire
from conveyor.strategies.ps.buckets import DEFAULT_BUCKET_BYTES, GradientBuckets
from conveyor.strategies.ps.optim import OptimizerSpec, group_hyperparameters
from conveyor.strategies.ps.sharding import DEFAULT_CHUNK_BYTES, Placement, place
from conveyor.strategies.ps.steps import PullInFlight, StepState

__all__ = ["PSClient", "PSConnections"]

log = logging.getLogger(__name__)

_SLEEP_MIN, _SLEEP_MAX = 0.0002, 0.005
_HOLD = 1.0  # seconds a server may hold a pull that it cannot answer yet (then it says 'wait', asked again)


class PSConnections:
    """A connection to every ps task, and the requests outside a training step (checkpoints, state, stats).

    Every request goes through :meth:`_send`/:meth:`_receive` with the typed messages of
    :mod:`.protocol`; callers never see headers or sockets. :class:`PSClient` adds the step protocol.
    """

    def __init__(self, addresses: Sequence[str], secret: bytes, *, rank: int, num_workers: int, sender: str,
                 timeout: float = 300.0) -> None:
        if not addresses:
            raise ValueError("parameter-server strategies need ps tasks: start the job with --ps M (M >= 1), or "
                             "list a 'ps' job in TF_CONFIG")
        self.rank = rank
        self.num_workers = num_workers
        self.timeout = timeout
        self._links = [Client(a, secret, name=f"ps:{i}", timeout=timeout, sender=sender)
                       for i, a in enumerate(addresses)]
        # a ping per server every quarter of the timeout, at least every 5 s: a dead server delays nothing long
        self._heartbeat = _Heartbeat(addresses, secret, sender, interval=min(timeout / 4, 5.0))
        self._closed = False

    @property
    def num_servers(self) -> int:
        return len(self._links)

    def _send(self, server: int, request: Any) -> int:
        return self._links[server].send(*request.encode())

    def _receive(self, server: int, request_id: int, *expected: type, what: str, timeout: float | None = None) -> Any:
        return wire.read_reply(self._links[server].receive(request_id, timeout), *expected, what=what,
                          num_workers=self.num_workers)

    def _settle(self) -> None:
        """Finish what is in flight before another request (the step protocol's pull)."""

    def _ask_all(self, requests: Sequence[Any], *expected: type, what: str) -> list[Any]:
        """One request to each server at once (``requests[s]`` to server ``s``); the replies in server order."""
        self._settle()
        ids = [self._send(s, request) for s, request in enumerate(requests)]
        return [self._receive(s, rid, *expected, what=what) for s, rid in enumerate(ids)]

    def _ask_first(self, request: Any, *expected: type, what: str) -> Any:
        """One request to ps:0 (the board of workers running apart)."""
        self._settle()
        return self._receive(0, self._send(0, request), *expected, what=what)

    # -- checkpoints and state --------------------------------------------------------------------

    def save_shards(self, step: int, root: str | Path) -> list[str]:
        """Every ps task writes its shard into checkpoint step ``step`` under ``root``; the file names written."""
        replies = self._ask_all([wire.Save(self.rank, step, str(root))] * self.num_servers, wire.SaveReply, what="save")
        return [part for reply in replies for part in reply.parts]

    def restore_shards(self, step: int, root: str | Path) -> None:
        """Every ps task loads its shard back from checkpoint step ``step`` under ``root``."""
        self._ask_all([wire.Restore(self.rank, step, str(root))] * self.num_servers, wire.OkReply, what="restore")

    def state(self) -> list[wire.StateReply]:
        """Every server's pieces and optimizer state (``meta`` JSON, ``named`` tensors; copies), in server order."""
        replies = self._ask_all([wire.State(self.rank)] * self.num_servers, wire.StateReply, what="state")
        return [wire.StateReply(r.meta, {n: t.clone() for n, t in r.named.items()}) for r in replies]

    def load_state(self, states: Sequence[tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> None:
        """Send each server its ``(meta, tensors)`` back (what :meth:`state` returned, in server order)."""
        if len(states) != self.num_servers:
            raise ValueError(f"{len(states)} server states for {self.num_servers} ps tasks")
        requests = [wire.LoadState(self.rank, meta, {n: t.contiguous() for n, t in tensors.items()})
                    for meta, tensors in states]
        self._ask_all(requests, wire.OkReply, what="load_state")

    def stats(self) -> list[wire.StatsReply]:
        """Every server's counters (staleness histogram, drops, ...), in server order."""
        return self._ask_all([wire.Stats(self.rank)] * self.num_servers, wire.StatsReply, what="stats")

    # -- the board of workers running apart (ps:0) ------------------------------------------------

    def publish_position(self, data: bytes) -> None:
        """Leave this worker's newest data position with ps:0 (workers running apart; see the server)."""
        self._ask_first(wire.Position(self.rank, bytes(data)), wire.OkReply, what="position")

    def positions(self) -> list[bytes | None]:
        """Every worker's newest position left with ps:0 (index = rank; None: nothing left yet)."""
        reply = self._ask_first(wire.Positions(self.rank), wire.PositionsReply, what="positions")
        return [reply.found.get(rank) for rank in range(self.num_workers)]

    def meet(self, key: int, data: bytes) -> list[bytes]:
        """Meeting ``key`` on ps:0, the workers' collectives where they run apart (``meetings.py``): every worker's
        ``data`` in rank order, once all sent theirs (asked again meanwhile, up to the timeout)."""
        deadline = time.monotonic() + self.timeout
        sleep = _SLEEP_MIN
        while True:
            reply = self._ask_first(wire.Meet(self.rank, bytes(data), int(key)), wire.PositionsReply, wire.WaitReply,
                                    what="meet")
            if isinstance(reply, wire.PositionsReply):
                return [reply.found[rank] for rank in range(self.num_workers)]
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"not every worker reached meeting {key} on ps:0 within {self.timeout:g} s: "
                                        f"another worker is stuck or gone (see its log)", name="ps:0",
                                        address=self._links[0].address)
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.05)

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self, *, done: bool = True) -> None:
        """Tell every server this worker is done (best effort) and close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._heartbeat.stop()  # while the servers still answer (the last "done" stops them)
        try:
            self._settle()
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self._release()
        if done:
            try:
                ids = [self._send(s, wire.Done(self.rank)) for s in range(self.num_servers)]
                for s, rid in enumerate(ids):
                    self._receive(s, rid, wire.OkReply, what="done", timeout=min(self.timeout, 10.0))
            except Exception:  # noqa: BLE001 - a server already gone is not an error at shutdown
                pass
        for link in self._links:
            link.close()

    def _release(self) -> None:
        """What a subclass lets go of before the servers hear "done" (the step protocol's hooks)."""


class PSClient(PSConnections):
    """Connections to every ps task and the per-step push/pull protocol.

    How it overlaps backward and the next batch: docs/ps.md, "The parameter-server strategy".
    """

    def __init__(self, addresses: Sequence[str], secret: bytes, *, rank: int, num_workers: int, sender: str,
                 timeout: float = 300.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if chunk_bytes > DEFAULT_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes = {chunk_bytes} is over {DEFAULT_CHUNK_BYTES}: ps tasks started by "
                             f"conveyor.init() refuse frames much larger than their default pieces")
        super().__init__(addresses, secret, rank=rank, num_workers=num_workers, sender=sender, timeout=timeout)
        self.chunk_bytes = chunk_bytes
        self.placement: Placement | None = None
        self.seconds: Counter[str] = Counter()  # push, pull, wait
        self.bytes_out = [0] * self.num_servers
        self.bytes_in = [0] * self.num_servers
        self.hooks_enabled = True
        #: steps committed by all workers together, and the total they stop at (from ps:0's commit replies)
        self.global_steps = 0
        self.plan: int | None = None
        self.announce: int | None = None  # a plan to send with the next commit
        #: the data position after this step's batch (the caller sets it before ``finish_step``), sent with the
        #: commit when it changed: what a replacement of this worker resumes from (:meth:`rejoin`)
        self.position: bytes | None = None
        self._sent_position: bytes | None = None
        self._bucket_bytes = bucket_bytes
        self._params: dict[str, nn.Parameter] = {}
        self._trained: set[str] = set()
        self._optimizer: torch.optim.Optimizer | None = None
        self._hyper: list[dict[str, Any]] | None = None
        self._handles: list[Any] = []
        #: the step being trained (made when the one before was committed) and the pull that feeds it
        self._step = StepState(0, [0] * self.num_servers, GradientBuckets(self.num_servers, bucket_bytes))
        self._pull: PullInFlight | None = None

    @property
    def step(self) -> int:
        """The step this worker trains now: the number of steps it committed."""
        return self._step.number

    # -- set-up -----------------------------------------------------------------------------------

    def connect(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Placement:
        """Place the parameters, initialise every server (rank 0's values win), pull, install the hooks."""
        named = list(model.named_parameters())
        spec = OptimizerSpec.from_optimizer(optimizer, named)
        self.placement = placement = place([(n, p.shape, p.dtype) for n, p in named], self.num_servers,
                                           self.chunk_bytes)
        self._params = dict(named)
        self._trained = set(spec.param_names)
        self._optimizer = optimizer
        self._hyper = group_hyperparameters(optimizer)
        inits = [self._init_request(s, spec, named) for s in range(self.num_servers)]
        deadline = time.monotonic() + self.timeout
        pending = list(range(self.num_servers))
        while pending:
            ids = [(s, self._send(s, inits[s])) for s in pending]
            replies = [(s, self._receive(s, rid, wire.InitReply, wire.WaitReply, what="init")) for s, rid in ids]
            pending = [s for s, reply in replies if isinstance(reply, wire.WaitReply)]
            if pending:
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"ps tasks {pending} were not initialised by worker 0 within "
                                            f"{self.timeout:g} s", name=f"ps:{pending[0]}", address="")
                time.sleep(0.05)
        self.pull()
        for name, param in named:
            if param.requires_grad and name in self._trained:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(name)))
        return placement

    def _init_request(self, server: int, spec: OptimizerSpec, named: list[tuple[str, nn.Parameter]]) -> wire.Init:
        """Worker 0's init carries the optimizer and the initial values; the others only the placement."""
        assert self.placement is not None
        if self.rank != 0:
            return wire.Init(self.placement.fingerprint, self.rank)
        pieces = self.placement.pieces_for(server)
        flat = {n: p.detach().reshape(-1) for n, p in named}
        return wire.Init(self.placement.fingerprint, self.rank, spec.to_json(), [p.key for p in pieces],
                    [flat[p.param][p.start:p.stop].clone() for p in pieces])

    def rejoin(self) -> bytes | None:
        """Take over where this worker's previous process left (it died; ps-async/ps-ssp): after :meth:`connect`,
        continue with the oldest step some server lacks, with the current parameters; returns the data position
        that server applied last (None: it was never sent; the data then starts over). The step is redone:
        servers that applied it, or some of its pieces, drop what they have (docs/ps.md, "A worker restarted
        alone")."""
        replies = self._ask_all([wire.Rejoin(self.rank)] * self.num_servers, wire.RejoinReply, what="rejoin")
        oldest = min(replies, key=lambda reply: reply.clock)
        self._step = StepState(oldest.clock, [0] * self.num_servers,
                               GradientBuckets(self.num_servers, self._bucket_bytes))
        self.position = self._sent_position = oldest.position
        self.pull()
        return oldest.position

    # -- pushing ----------------------------------------------------------------------------------

    def _hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if self.hooks_enabled and param.grad is not None:
                self.push(name, param.grad)
        return hook

    def push(self, name: str, grad: torch.Tensor) -> None:
        """Queue the gradient of parameter ``name`` for the servers holding its pieces; a full bucket leaves now.

        Replies are collected by :meth:`finish_step`, which also sends what is left in the bucket.
        """
        start = time.perf_counter()
        assert self.placement is not None
        self._step.add(name, self.placement.split(name, grad.detach()))
        if self._step.buckets.full:
            self._flush()
        self.seconds["push"] += time.perf_counter() - start

    def _flush(self) -> None:
        """One push per server of what waits in the step's bucket."""
        for server, request in self._step.take_pushes(self.rank):
            self._step.in_flight.append((server, self._send(server, request)))
            self.bytes_out[server] += sum(t.numel() * t.element_size() for t in request.grads)

    def finish_step(self, prefetch: bool = False) -> None:
        """Push what the hooks did not, commit the step on every server, then pull for the next step.

        ``prefetch``: only send the pull; :meth:`finish_pull` (called by the model's forward pre-hook and
        state_dict pre-hook, see the strategy) receives it, so the round trip overlaps what the worker
        does before its next forward (loading the next batch).
        """
        self.finish_pull()
        start = time.perf_counter()
        step = self._step
        for name, param in self._params.items():  # model order: the same pushes on every run
            if name in self._trained and name not in step.pushed and param.grad is not None:
                self.push(name, param.grad)
        self._flush()
        hyper = group_hyperparameters(self._optimizer) if self._optimizer is not None else None
        changed = hyper if hyper != self._hyper else None
        self._hyper = hyper
        position = self.position if self.position != self._sent_position else None
        self._sent_position = self.position
        commits = [self._send(s, wire.Commit(self.rank, step.number, step.read[s], changed, self.announce, position))
                   for s in range(self.num_servers)]
        self._step = step.next()
        # Right behind the commit, not after its reply: a server handles a connection's requests in order,
        # so the pull sees the commit, and the step costs one round trip to the servers instead of two.
        self.start_pull()
        for server, rid in step.in_flight:
            self._receive(server, rid, wire.OkReply, what="push")
        for server, rid in enumerate(commits):
            reply = self._receive(server, rid, wire.CommitReply, what="commit")
            if server == 0:
                self.global_steps, self.plan = reply.total, reply.plan
        self.seconds["push"] += time.perf_counter() - start
        if not prefetch:
            self.finish_pull()

    # -- pulling ----------------------------------------------------------------------------------

    def pull(self) -> None:
        """Fetch every piece for step ``self.step`` (waiting while a server says so) into the parameters."""
        self.start_pull()
        self.finish_pull()

    def start_pull(self) -> None:
        """Send the pull for step ``self.step`` to every server; :meth:`finish_pull` collects it."""
        if self._pull is None:
            step = self.step
            self._pull = PullInFlight(step, [(s, self._send(s, self._pull_request(step)))
                                             for s in range(self.num_servers)])

    @torch.no_grad()
    def finish_pull(self) -> None:
        """Wait for the pull in flight (asking again while a server answers ``wait``) and copy it in."""
        if self._pull is None:
            return
        assert self.placement is not None
        pull, self._pull = self._pull, None
        replies = self._collect_pull(pull)
        start = time.perf_counter()
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for s, reply in replies.items():
            self._step.read[s] = reply.version
            for key, value in zip(reply.keys, reply.values, strict=True):
                parts.setdefault(self.placement.piece(key).param, []).append((key, value))
                self.bytes_in[s] += value.numel() * value.element_size()
        for name, param in self._params.items():
            param.copy_(self.placement.join(name, parts[name]).view_as(param))
        self.seconds["pull"] += time.perf_counter() - start

    def _pull_request(self, step: int) -> wire.Pull:
        """A pull for ``step`` the server may hold until it can answer (well within this client's timeout)."""
        return wire.Pull(self.rank, step, hold=max(1, int(min(_HOLD, self.timeout / 4) * 1000)))

    def _collect_pull(self, pull: PullInFlight) -> dict[int, wire.ParamsReply]:
        """The pull's replies by server, asking again (after 0.2 ms, doubling up to 5 ms) while a server says wait.

        Servers hold a pull they cannot answer yet for up to a second (``Pull.hold``) and answer it the
        moment a commit makes it ready, so 'wait' mostly means a second went by (or a server not yet
        initialised); the time a reply says it was held counts as waiting for servers.
        """
        replies: dict[int, wire.ParamsReply] = {}
        ids = pull.ids
        sleep = _SLEEP_MIN
        deadline = time.monotonic() + self.timeout
        while ids:
            start = time.perf_counter()
            again = []
            for s, rid in ids:
                reply = self._receive(s, rid, wire.ParamsReply, wire.WaitReply, what="pull")
                if isinstance(reply, wire.WaitReply):
                    again.append(s)
                else:
                    replies[s] = reply
            if not again:
                took = time.perf_counter() - start
                held = min(took, max(replies[s].held for s, _ in ids) / 1e6)  # a held pull waited for servers
                self.seconds["wait"] += held
                self.seconds["pull"] += took - held
                break
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"ps task(s) {again} kept answering 'wait' to the pull for step "
                                        f"{pull.step} for {self.timeout:g} s: another worker is stuck or gone",
                                        name=f"ps:{again[0]}", address=self._links[again[0]].address)
            time.sleep(sleep)
            sleep = min(sleep * 2, _SLEEP_MAX)
            ids = [(s, self._send(s, self._pull_request(pull.step))) for s in again]
            self.seconds["wait"] += time.perf_counter() - start
        return replies

    # -- lifetime ---------------------------------------------------------------------------------

    def _settle(self) -> None:
        self.finish_pull()

    def _release(self) -> None:
        for handle in self._handles:
            handle.remove()


class _Heartbeat:
    """Pings every server every ``interval`` seconds from a daemon thread, on its own connections."""

    def __init__(self, addresses: Sequence[str], secret: bytes, sender: str, *, interval: float) -> None:
        self._addresses = list(addresses)
        self._secret = secret
        self._sender = sender
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-ps-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # The sockets are made and closed here: a ZeroMQ socket belongs to one thread.
        clients = [Client(a, self._secret, name=f"ps:{i}", timeout=self.interval, sender=self._sender)
                   for i, a in enumerate(self._addresses)]
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    ids = [(c, c.send(*wire.Ping().encode())) for c in clients]
                    for c, rid in ids:
                        c.receive(rid, timeout=max(0.001, started + self.interval - time.monotonic()))
                except TransportError as exc:  # the server's own log tells more; tried again next round
                    log.debug("heartbeat: %s", exc)
                self._stop.wait(max(0.0, started + self.interval - time.monotonic()))
        finally:
            for c in clients:
                c.close()

    def stop(self) -> None:
        """Stop pinging; the thread ends by itself within ``interval`` (a ping to a dead server times out)."""
        self._stop.set()
        self._thread.join(min(self.interval, 1.0))
