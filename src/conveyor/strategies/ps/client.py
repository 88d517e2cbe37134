"""The worker's side of the parameter servers: push gradients as backward makes them, pull parameters.

    client = PSClient(["127.0.0.1:2222", "127.0.0.1:2223"], secret, rank=0, num_workers=2, sender="worker:0")
    client.connect(model, optimizer)     # placement, init of every server, first pull, autograd hooks
    loss.backward()                      # each parameter's gradient is pushed as soon as it is accumulated
    client.finish_step()                 # remaining pushes + commit to every server, then the pull

One transport :class:`~conveyor.comm.transport.Client` per ps task. Requests to all servers are in
flight at once (``send`` to each, then ``receive`` from each). Gradients leave from a
``register_post_accumulate_grad_hook`` per parameter, so a layer's gradient travels while backward
still computes the earlier layers; the replies are collected in :meth:`finish_step`. Pulled pieces are
joined (:meth:`Placement.join`) and copied into the model's parameters in place, so the user's model
object, and anything holding its parameters, stays valid.

A daemon thread pings every server every quarter of ``timeout`` (at most 5 s) on connections of its own, from
construction to :meth:`close`: a ps task stops after a timeout without hearing from any worker (so
that it cannot outlive its job), and the pings keep it up while this worker is alive but busy elsewhere
(evaluation, checkpoints, a slow data pipeline).

A server that answers ``wait`` (the update rule does not allow the pull yet) is asked again after a
short sleep (0.2 ms, doubling up to 5 ms): that time is the *wait-for-servers* time.

Gradient accumulation over several ``backward()`` calls before one ``step()`` is supported by
``ps-sync`` (the last push of a piece in a step replaces the earlier ones on the server, and it holds
the accumulated sum). With ``ps-async``/``ps-ssp`` every push is applied when it arrives, so do one
backward per step there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from conveyor.comm.framing import Message
from conveyor.comm.transport import Client, ServerUnavailable, TransportError
from conveyor.strategies.ps.optim import OptimizerSpec, group_hyperparameters
from conveyor.strategies.ps.sharding import DEFAULT_CHUNK_BYTES, Placement, place

__all__ = ["PSClient"]

log = logging.getLogger(__name__)

_SLEEP_MIN, _SLEEP_MAX = 0.0002, 0.005


class PSClient:
    """Connections to every ps task and the per-step push/pull protocol (see the module docstring)."""

    def __init__(self, addresses: Sequence[str], secret: bytes, *, rank: int, num_workers: int, sender: str,
                 timeout: float = 300.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if not addresses:
            raise ValueError("parameter-server strategies need ps tasks: start the job with --ps M (M >= 1), or "
                             "list a 'ps' job in TF_CONFIG")
        if chunk_bytes > DEFAULT_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes = {chunk_bytes} is over {DEFAULT_CHUNK_BYTES}: ps tasks started by "
                             f"conveyor.init() refuse frames much larger than their default pieces")
        self.rank = rank
        self.num_workers = num_workers
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.clients = [Client(a, secret, name=f"ps:{i}", timeout=timeout, sender=sender)
                        for i, a in enumerate(addresses)]
        # a ping per server every quarter of the timeout, at least every 5 s: a dead server delays nothing long
        self._heartbeat = _Heartbeat(addresses, secret, sender, interval=min(timeout / 4, 5.0))
        self.placement: Placement | None = None
        self.step = 0
        self.read = [0] * len(self.clients)  # the version each server reported at the last pull
        self.seconds: Counter[str] = Counter()  # push, pull, wait
        self.bytes_out = [0] * len(self.clients)
        self.bytes_in = [0] * len(self.clients)
        self.hooks_enabled = True
        #: steps committed by all workers together, and the total they stop at (from ps:0's commit replies)
        self.global_steps = 0
        self.plan: int | None = None
        self.announce: int | None = None  # a plan to send with the next commit
        self._pending: list[tuple[int, int]] = []  # (server, request id) of pushes in flight
        self._pushed: set[str] = set()  # parameters pushed this step
        self._keep: list[torch.Tensor] = []  # gradient copies in flight (must not change until replied)
        self._params: dict[str, nn.Parameter] = {}
        self._trained: set[str] = set()
        self._optimizer: torch.optim.Optimizer | None = None
        self._hyper: list[dict[str, Any]] | None = None
        self._handles: list[Any] = []
        self._pulls: list[tuple[int, int]] | None = None  # (server, request id) of the pull in flight
        self._closed = False

    # -- set-up -----------------------------------------------------------------------------------

    def connect(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Placement:
        """Place the parameters, initialise every server (rank 0's values win), pull, install the hooks."""
        named = list(model.named_parameters())
        spec = OptimizerSpec.from_optimizer(optimizer, named)
        self.placement = placement = place([(n, p.shape, p.dtype) for n, p in named], len(self.clients),
                                           self.chunk_bytes)
        self._params = dict(named)
        self._trained = set(spec.param_names)
        self._optimizer = optimizer
        self._hyper = group_hyperparameters(optimizer)
        deadline = time.monotonic() + self.timeout
        pending = list(range(len(self.clients)))
        while pending:
            ids = []
            for s in pending:
                header: dict[str, Any] = {"fingerprint": placement.fingerprint, "rank": self.rank}
                tensors: list[torch.Tensor] = []
                if self.rank == 0:
                    pieces = placement.pieces_for(s)
                    header.update(spec=spec.to_json(), keys=[p.key for p in pieces])
                    flat = {n: p.detach().reshape(-1) for n, p in named}
                    tensors = [flat[p.param][p.start:p.stop].clone() for p in pieces]
                ids.append((s, self.clients[s].send("init", header, tensors)))
            pending = [s for s, rid in ids if self.clients[s].receive(rid).kind == "wait"]
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

    # -- pushing ----------------------------------------------------------------------------------

    def _hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if self.hooks_enabled and param.grad is not None:
                self.push(name, param.grad)
        return hook

    def push(self, name: str, grad: torch.Tensor) -> None:
        """Send the gradient of parameter ``name`` to the servers holding its pieces (replies: finish_step)."""
        start = time.perf_counter()
        assert self.placement is not None
        by_server: dict[int, tuple[list[str], list[torch.Tensor]]] = {}
        for piece, values in self.placement.split(name, grad.detach()):
            copy = values.clone()  # the grad may be changed in place (accumulation) before the reply
            keys, tensors = by_server.setdefault(piece.server, ([], []))
            keys.append(piece.key)
            tensors.append(copy)
        for server, (keys, tensors) in by_server.items():
            header = {"rank": self.rank, "step": self.step, "read": self.read[server], "keys": keys}
            self._pending.append((server, self.clients[server].send("push", header, tensors)))
            self._keep.extend(tensors)
            self.bytes_out[server] += sum(t.numel() * t.element_size() for t in tensors)
        self._pushed.add(name)
        self.seconds["push"] += time.perf_counter() - start

    def finish_step(self, prefetch: bool = False) -> None:
        """Push what the hooks did not, commit the step on every server, then pull for the next step.

        ``prefetch``: only send the pull; :meth:`finish_pull` (called by the model's forward pre-hook and
        state_dict pre-hook, see the strategy) receives it, so the round trip overlaps what the worker
        does before its next forward (loading the next batch).
        """
        self.finish_pull()
        start = time.perf_counter()
        for name in self._trained:
            param = self._params[name]
            if name not in self._pushed and param.grad is not None:
                self.push(name, param.grad)
        hyper = group_hyperparameters(self._optimizer) if self._optimizer is not None else None
        changed = hyper if hyper != self._hyper else None
        self._hyper = hyper
        commits = []
        for server, client in enumerate(self.clients):
            header = {"rank": self.rank, "step": self.step, "read": self.read[server], "hyper": changed,
                      "plan": self.announce}
            commits.append(client.send("commit", header))
        for server, rid in self._pending:
            self._check(self.clients[server].receive(rid), "push")
        self._pending.clear()
        for server, rid in enumerate(commits):
            reply = self.clients[server].receive(rid)
            self._check(reply, "commit")
            if server == 0:
                self.global_steps = int(reply.header.get("total", 0))
                self.plan = reply.header.get("plan")
        self._keep.clear()
        self._pushed.clear()
        self.seconds["push"] += time.perf_counter() - start
        self.step += 1
        self.start_pull()
        if not prefetch:
            self.finish_pull()

    # -- pulling ----------------------------------------------------------------------------------

    def pull(self) -> None:
        """Fetch every piece for step ``self.step`` (waiting while a server says so) into the parameters."""
        self.start_pull()
        self.finish_pull()

    def start_pull(self) -> None:
        """Send the pull for step ``self.step`` to every server; :meth:`finish_pull` collects it."""
        if self._pulls is None:
            self._pulls = [(s, c.send("pull", {"rank": self.rank, "step": self.step}))
                           for s, c in enumerate(self.clients)]

    @torch.no_grad()
    def finish_pull(self) -> None:
        """Wait for the pull in flight (asking again while a server answers ``wait``) and copy it in."""
        if self._pulls is None:
            return
        assert self.placement is not None
        replies: dict[int, Message] = {}
        ids, self._pulls = self._pulls, None
        sleep = _SLEEP_MIN
        deadline = time.monotonic() + self.timeout
        while ids:
            start = time.perf_counter()
            again = []
            for s, rid in ids:
                reply = self.clients[s].receive(rid)
                if reply.kind == "wait":
                    again.append(s)
                else:
                    self._check(reply, "pull")
                    replies[s] = reply
            if again:
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"ps task(s) {again} kept answering 'wait' to the pull for step "
                                            f"{self.step} for {self.timeout:g} s: another worker is stuck or gone",
                                            name=f"ps:{again[0]}", address=self.clients[again[0]].address)
                time.sleep(sleep)
                sleep = min(sleep * 2, _SLEEP_MAX)
                ids = [(s, self.clients[s].send("pull", {"rank": self.rank, "step": self.step})) for s in again]
                self.seconds["wait"] += time.perf_counter() - start
            else:
                self.seconds["pull"] += time.perf_counter() - start
                ids = []
        start = time.perf_counter()
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for s, reply in replies.items():
            self.read[s] = int(reply.header["version"])
            for key, value in zip(reply.header["keys"], reply.torch_tensors(), strict=True):
                parts.setdefault(self.placement.piece(key).param, []).append((key, value))
                self.bytes_in[s] += value.numel() * value.element_size()
        for name, param in self._params.items():
            param.copy_(self.placement.join(name, parts[name]).view_as(param))
        self.seconds["pull"] += time.perf_counter() - start

    def _check(self, reply: Message, what: str) -> None:
        if reply.kind not in ("ok", "params"):
            raise RuntimeError(f"unexpected {reply.kind!r} reply to a {what} request")

    # -- other requests ---------------------------------------------------------------------------

    def request_all(self, kind: str, headers: Sequence[dict[str, Any]] | None = None,
                    tensors: Sequence[Sequence[Any]] | None = None) -> list[Message]:
        """One request to every server at once; the replies in server order (after any pull in flight)."""
        self.finish_pull()
        ids = [c.send(kind, headers[s] if headers else {"rank": self.rank}, tensors[s] if tensors else ())
               for s, c in enumerate(self.clients)]
        return [c.receive(rid) for c, rid in zip(self.clients, ids, strict=True)]

    def publish_position(self, data: bytes) -> None:
        """Leave this worker's newest data position with ps:0 (workers running apart; see the server)."""
        self.finish_pull()
        client = self.clients[0]
        self._check(client.receive(client.send("position", {"rank": self.rank},
                                               [torch.frombuffer(bytearray(data), dtype=torch.uint8)])), "position")

    def positions(self) -> list[bytes | None]:
        """Every worker's newest position left with ps:0 (index = rank; None: nothing left yet)."""
        self.finish_pull()
        client = self.clients[0]
        reply = client.receive(client.send("positions", {"rank": self.rank}))
        if reply.kind != "positions":
            raise RuntimeError(f"unexpected {reply.kind!r} reply to a positions request")
        found: list[bytes | None] = [None] * self.num_workers
        for rank, tensor in zip(reply.header["ranks"], reply.torch_tensors(), strict=True):
            found[int(rank)] = tensor.numpy().tobytes()
        return found

    def close(self, *, done: bool = True) -> None:
        """Tell every server this worker is done (best effort), remove the hooks and close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._heartbeat.stop()  # while the servers still answer (the last "done" stops them)
        try:
            self.finish_pull()
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        for handle in self._handles:
            handle.remove()
        if done:
            try:
                ids = [(c, c.send("done", {"rank": self.rank})) for c in self.clients]
                for c, rid in ids:
                    c.receive(rid, timeout=min(self.timeout, 10.0))
            except Exception:  # noqa: BLE001 - a server already gone is not an error at shutdown
                pass
        for client in self.clients:
            client.close()


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
                    ids = [(c, c.send("ping")) for c in clients]
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
