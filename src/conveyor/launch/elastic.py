"""Elastic membership: `conveyor run --nnodes MIN:MAX`, the job re-formed in rounds as machines come and go.

    members = Membership.start("10.0.0.1:29400", NodeSpan(2, 4), host=True, workers=2, ps=0, settings=s, ...)
    rnd = members.next_round(attempt=0)   # blocks until a round with this node closes: nodes, rank, peers
    Supervisor(build_plan(opts, rnd.nodes, rnd.node_rank, ...), peers=rnd.peers, first_attempt=rnd.attempt)
    members.finish(ok=True, message="...")  # waiting joiners are told; node 0 keeps the store until all left

Node 0 (``--node-rank 0``) hosts the store, keeps rank 0 for the whole job and runs the coordinator thread,
which alone decides the rounds. Every other launcher takes a member id (a counter) and asks for a round with
a signed ``want`` record. A round closes when MAX nodes want it, or when at least MIN do, every survivor
of the last round is back and ``last_call`` seconds passed since the last newcomer asked (none since: at once);
with fewer than MIN after ``timeout`` the job fails naming both counts. Node ranks are dense: node 0, the
survivors in their old order, newcomers by arrival. While a round runs, a member silent for ``node_timeout``,
or whose lifeline to node 0 closed (its launcher died: ``launch/liveness.py``), makes the coordinator write
``regroup/<round>``: every supervisor stops its tasks and asks for the next round. A node
that asks meanwhile waits, and joins when the job next re-forms: a new checkpoint, the restart after a
failure, or a lost node. A joiner with other settings, or a node declared lost that speaks again, is
refused naming why. Records are signed as in ``launch/rendezvous.py``. Why: docs/launcher.md, "Elastic
membership".
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from conveyor.cluster import split_address
from conveyor.errors import PeerError, RendezvousError
from conveyor.fileio import atomic_write
from conveyor.launch.liveness import Heartbeat, Lifelines, beat_interval, farewell, lifeline
from conveyor.launch.plan import NodeInfo
from conveyor.launch.ports import free_ports
from conveyor.launch.rendezvous import (
    StorePeers,
    _call,
    _check_not_loopback,
    _client,
    _connect,
    _seal,
    _unseal,
    local_address,
    settings_difference,
)
from conveyor.recovery import drain_path
from conveyor.stepfolders import CheckpointError, resume_step

__all__ = ["JobEnded", "Membership", "NodeSpan", "Round", "RoundPeers", "parse_nnodes", "round_decision"]

_P = "conveyor/"
_POLL = 0.1
_CHECKPOINT_LOOK = 1.0  # how often the coordinator looks for a new checkpoint while a node waits (no drain asked)
_UNRANKED = "(elastic, not yet ranked)"  # how a joiner names itself before it has a node rank


@dataclass(frozen=True)
class NodeSpan:
    """``--nnodes``: ``K`` is ``K:K`` (a job of fixed size), ``MIN:MAX`` an elastic one."""

    min: int
    max: int

    @property
    def elastic(self) -> bool:
        return self.min != self.max

    def __str__(self) -> str:
        return f"{self.min}:{self.max}" if self.elastic else str(self.min)


def parse_nnodes(text: str) -> NodeSpan:
    """``--nnodes K`` or ``MIN:MAX`` (torchrun's spelling), checked; ValueError names the flag and the fix."""
    parts = str(text).split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--nnodes {text!r}: expected a number of machines K, or MIN:MAX for an elastic job, "
                         f"whole numbers (e.g. --nnodes 2, --nnodes 2:4)")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise ValueError(f"--nnodes {text}: expected 1 or more machines (a job has at least node 0, which hosts "
                         f"the rendezvous), e.g. --nnodes 1:{max(high, 2)}")
    if low > high:
        raise ValueError(f"--nnodes {text}: MIN {low} is above MAX {high}; give MIN:MAX with MIN <= MAX, "
                         f"e.g. --nnodes {high}:{low}")
    return NodeSpan(low, high)


def round_decision(*, have: int, missing: int, span: NodeSpan, now: float, opened: float, last_change: float,
                   last_call: float, timeout: float) -> Literal["close", "wait", "fail"]:
    """Whether the round being collected closes now (pure). ``have``: the nodes that want it, node 0 among
    them; ``missing``: the last round's survivors (node 0 included) not back yet; ``opened``: when the round
    opened; ``last_change``: when ``have`` last changed."""
    if have >= span.max and not missing:
        return "close"
    if have >= span.min and not missing and now - last_change >= last_call:
        return "close"
    if now - opened > timeout:  # a survivor still not back joins the round after
        return "close" if have >= span.min else "fail"
    return "wait"


class JobEnded(Exception):
    """The job ended while this node waited for a round it was not needed in (``ok``: it succeeded)."""

    def __init__(self, ok: bool, message: str) -> None:
        super().__init__(message)
        self.ok = ok


class RoundPeers(StorePeers):
    """The supervisor's peers for one membership round: :class:`StorePeers` (whose per-attempt keys never
    repeat across rounds: attempts go on counting), plus :meth:`regroup`."""

    def __init__(self, store: Any, *, round_number: int, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        self.round = round_number
        self.left_prefix = f"{_P}left/r{round_number}"  # ranks are the round's: another round's must not count

    def regroup(self) -> str | None:
        return self._description(f"{_P}regroup/{self.round}")


@dataclass(frozen=True)
class Round:
    """One membership round as this node joined it."""

    number: int
    attempt: int  # the supervisor's first attempt in this round (attempts go on counting across rounds)
    nodes: tuple[NodeInfo, ...]
    node_rank: int
    master_addr: str
    master_port: int
    peers: RoundPeers = field(repr=False)
    names: tuple[str, ...] = ()


def _node_record(record: Mapping[str, Any]) -> NodeInfo:
    return NodeInfo(str(record["host"]), int(record["workers"]), int(record["ps"]),
                    tuple(int(p) for p in record["ports"]))


def _name(record: Mapping[str, Any]) -> str:
    return f"{record.get('hostname') or '?'} at {record.get('host')}"


class Membership:
    """One launcher's part in an elastic job, from its first round to the job's end (module docstring)."""

    def __init__(self, endpoint: str, span: NodeSpan, *, host: bool, workers: int, ps: int,
                 settings: Mapping[str, Any], secret: bytes, timeout: float, last_call: float,
                 node_timeout: float, checkpoint_dir: str) -> None:
        self.endpoint, self.span, self.host = endpoint, span, host
        self.timeout, self.node_timeout = timeout, node_timeout
        self._secret = secret
        rdzv_host, port = split_address(endpoint, "--rdzv")
        self._address = local_address(rdzv_host, port)
        if host:
            _check_not_loopback(rdzv_host, port, endpoint)
        ports = free_ports(workers + ps + (1 if host else 0), self._address)
        self._mine = {"host": self._address, "workers": workers, "ps": ps, "ports": ports[:workers + ps],
                      "settings": {"nnodes": str(span), **settings}, "hostname": socket.gethostname()}
        self._store = _connect(rdzv_host, port, endpoint, 0 if host else _UNRANKED, timeout)
        self._io = self._peers(self._store, 0)
        self._connect_twin = lambda: _client(rdzv_host, port, endpoint, 0 if host else _UNRANKED, timeout)
        self._coordinator: Coordinator | None = None
        self._heart: Heartbeat | None = None
        self._last: RoundPeers | None = None
        self._lifeline = None  # a member's connection to node 0 (launch/liveness.py): its close is its loss
        self.id = 0
        if host:
            run = secrets.token_hex(16)
            lifelines = Lifelines(self._address, secret=secret, run=run)
            job = {"master_port": ports[-1], "run": run, "lifeline_port": lifelines.port}
            _call(self._store.set, endpoint, f"{_P}job", _seal(secret, f"{_P}job", job), timeout=timeout)
            self._io.run = job["run"]
            self._coordinator = Coordinator(self._peers(self._connect_twin(), 0), span=span, endpoint=endpoint,
                                            settings=self._mine["settings"], timeout=timeout, last_call=last_call,
                                            node_timeout=node_timeout, checkpoint_dir=checkpoint_dir,
                                            lifelines=lifelines)
            self._coordinator.start()
        else:
            self._join()
        self._job = self._read_job()
        self._next = 0 if host else self._open_round()

    def _peers(self, store: Any, node_rank: int, nnodes: int = 1, **kwargs: Any) -> Any:
        cls = RoundPeers if kwargs else StorePeers
        peers = cls(store, nnodes=nnodes, node_rank=node_rank, endpoint=self.endpoint, timeout=self.timeout,
                    secret=self._secret, **kwargs)
        peers.run = getattr(self, "_io", peers).run
        return peers

    def _read_job(self) -> dict:
        key = f"{_P}job"
        self._wait(lambda: _call(self._store.check, self.endpoint, [key], timeout=self.timeout),
                   f"node 0 did not publish the job at the rendezvous {self.endpoint} within {self.timeout:g} s; "
                   f"start node 0's launcher (conveyor run --nnodes {self.span} --node-rank 0 --rdzv {self.endpoint})")
        return _unseal(self._secret, key, _call(self._store.get, self.endpoint, key, timeout=self.timeout),
                       self.endpoint)

    def _join(self) -> None:
        """Take a member id, open the lifeline, and beat from a thread of its own (node 0 drops a joiner that falls
        silent, or whose lifeline closes)."""
        job = self._read_job()
        self._io.run = str(job["run"])
        self.id = int(_call(self._store.add, self.endpoint, f"{_P}joins", 1, timeout=self.timeout))
        if job.get("lifeline_port"):
            host, _ = split_address(self.endpoint, "--rdzv")
            self._lifeline = lifeline(host, int(job["lifeline_port"]), secret=self._secret, run=self._io.run,
                                      member=self.id, timeout=min(5.0, self.timeout))
        beater = self._peers(self._connect_twin(), self.id, nnodes=2)
        beater.beat_key = f"{_P}alive/m{self.id}"
        self._heart = Heartbeat(beater, hosts=(), timeout=self.node_timeout)
        self._heart.start()

    def _open_round(self) -> int:
        key = f"{_P}open"
        self._wait(lambda: self._io._read(key) is not None, f"node 0 opened no round at {self.endpoint}")
        return int(self._io._read(key)["round"])

    def _wait(self, ready: Callable[[], bool], what: str, seconds: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout if seconds is None else seconds)
        while not ready():
            if time.monotonic() > deadline:
                raise RendezvousError(what)
            time.sleep(_POLL)

    def next_round(self, attempt: int) -> Round:
        """Ask for the next round and wait until one with this node closes (a fresh joiner: the open one)."""
        want = {**self._mine, "attempt": attempt}
        r = self._next
        self._put(f"{_P}want/{r}/{self.id}", want)
        said = False
        node0 = _Silence(self.node_timeout)
        while True:
            self._check_job_goes_on(node0)
            record = self._io._read(f"{_P}round/{r}")
            if record is None:
                time.sleep(_POLL)
                continue
            members = [int(m) for m in record["members"]]
            if self.id in members:
                self._next = r + 1
                return self._round(r, record, members)
            if not said:  # the round closed without it: it joins at the next
                print(f"[conveyor] round {r} of the job at {self.endpoint} runs with {len(members)} node(s); this "
                      f"node waits to join the next (at a new checkpoint, or a restart)", file=sys.stderr, flush=True)
                said = True
            r += 1
            self._put(f"{_P}want/{r}/{self.id}", want)

    def _check_job_goes_on(self, node0: _Silence) -> None:
        reason = self._io.aborted()
        if reason:
            raise RendezvousError(reason)
        refused = self._io._read(f"{_P}refused/{self.id}")
        if refused is not None:
            raise RendezvousError(str(refused.get("description")))
        ended = self._io._read(f"{_P}ended")
        if ended is not None:
            self._put(f"{_P}left/m{self.id}", {"node": self.id})  # node 0 keeps the store until it is read
            raise JobEnded(bool(ended.get("ok")), str(ended.get("description")))
        if node0.silent(self._io.beat_at(f"{_P}alive/m0")):
            raise PeerError(f"node 0's launcher at {self.endpoint} stopped coordinating (no beat for "
                            f"{self.node_timeout:g} s); start the job again")

    def _round(self, r: int, record: Mapping[str, Any], members: list[int]) -> Round:
        nodes = tuple(_node_record(n) for n in record["nodes"])
        rank = members.index(self.id)
        peers = self._peers(self._store, rank, nnodes=len(nodes), round_number=r)
        peers.training_nodes = tuple(i for i, n in enumerate(nodes) if n.workers)
        peers.joined = True
        self._last = peers
        return Round(number=r, attempt=int(record["attempt"]), nodes=nodes, node_rank=rank,
                     master_addr=nodes[0].host, master_port=int(self._job["master_port"]), peers=peers,
                     names=tuple(_name(n) for n in record["nodes"]))

    def _put(self, key: str, record: Mapping[str, Any]) -> None:
        _call(self._store.set, self.endpoint, key, self._io._sealed(key, dict(record)), timeout=self.timeout)

    def finish(self, ok: bool | None = None, message: str = "") -> None:
        """Leave the job. Node 0 (``ok`` given: the job ended) tells the joiners still waiting, then keeps the
        store until the last round's nodes have left."""
        if self._coordinator is not None:
            self._coordinator.stop()
            if ok is not None:
                with contextlib.suppress(PeerError):
                    self._put(f"{_P}ended", {"ok": ok, "description": message})
                    waiting = [n for n in self._coordinator.wants if n not in self._coordinator.members]
                    left = [f"{_P}left/m{n}" for n in waiting]
                    with contextlib.suppress(RendezvousError):  # a joiner gone meanwhile: not for ever
                        self._wait(lambda: all(self._io._read(key) is not None for key in left), "",
                                   min(5.0, self.timeout))
        if self._heart is not None:
            self._heart.stop()
        farewell(self._lifeline)  # leaving on purpose: no loss
        if self._last is not None:
            self._last.close()


class _Silence:
    """Whether a beat count has stopped growing for ``seconds`` (None: no beat seen yet counts from now)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last: int | None = None
        self.since = time.monotonic()

    def silent(self, beat: int | None) -> bool:
        now = time.monotonic()
        if beat is not None and (self.last is None or beat > self.last):
            self.last, self.since = beat, now
        return now - self.since > max(self.seconds, 2 * beat_interval(self.seconds) + 1.0)


class Coordinator:
    """Node 0's thread that decides the rounds (module docstring), on a store connection of its own.

    Long because it is the membership state machine: reading the joiners, watching their beats, closing a
    round or failing it, and deciding when a running round must be re-formed.
    """

    def __init__(self, io: StorePeers, *, span: NodeSpan, endpoint: str, settings: Mapping[str, Any],
                 timeout: float, last_call: float, node_timeout: float, checkpoint_dir: str,
                 lifelines: Lifelines | None = None) -> None:
        self._io, self.span, self.endpoint, self._settings = io, span, endpoint, dict(settings)
        self.timeout, self.last_call, self.node_timeout = timeout, last_call, node_timeout
        self._checkpoints = checkpoint_dir
        self._drain = drain_path(os.path.dirname(os.path.abspath(checkpoint_dir)))  # <output>/logs/drain
        self._drain_asked = False
        self._lifelines = lifelines
        self.closed: set[int] = set()  # members whose lifeline closed: lost at once, not after node_timeout
        self.round, self.collecting = 0, True
        self.opened = self.last_change = time.monotonic()
        self.members: list[int] = []  # the running round's member ids, in rank order
        self.expected: set[int] = {0}  # who must be back before the round closes early: node 0, the survivors
        self.wants: dict[int, dict] = {}  # id -> its record, for the round being collected or the next one
        self.heard: dict[int, tuple[int, float]] = {}  # id -> (beat, when it last grew)
        self.lost: set[int] = set()
        self.refused: set[int] = set()
        self._attempt = 0  # the next attempt whose failure re-forms a round a joiner waits for
        self._mark: tuple[float, int | None] | None = None  # (next look, step) once a joiner waits
        self._beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-membership", daemon=True)

    def start(self) -> None:
        self._withdraw(force=True)  # an earlier job's request in this output folder could name a round of this one
        self._put(f"{_P}open", {"round": 0})
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout + 5.0)
        if self._lifelines is not None:
            self._lifelines.close()
        self._withdraw(force=True)
        self._io.release()

    def _run(self) -> None:
        try:
            while not self._stop.wait(_POLL):
                self.tick(time.monotonic())
        except PeerError:
            return  # node 0's own store is unreachable: its run loop says so
        except (ValueError, KeyError, TypeError) as e:  # a record of another version: end the job, saying it
            self._fail(f"rendezvous at {self.endpoint}: a membership record is malformed ({type(e).__name__}: "
                       f"{e}); is another conveyor version using this address?")

    def tick(self, now: float) -> None:
        """One look at the store: the joiners, the beats, then the round's decision."""
        self._beats += 1
        self._io.beat_key = f"{_P}alive/m0"
        self._io.beat(self._beats)  # waiting joiners know the coordinator lives
        self._read_wants(now)
        self._watch(now)
        if self.collecting:
            self._collect(now)
        else:
            self._running(now)

    def _put(self, key: str, record: Mapping[str, Any]) -> None:
        _call(self._io._store.set, self.endpoint, key, self._io._sealed(key, dict(record)), timeout=self.timeout)

    def _read_wants(self, now: float) -> None:
        target = self.round if self.collecting else self.round + 1
        count = int(_call(self._io._store.add, self.endpoint, f"{_P}joins", 0, timeout=self.timeout))
        for node in range(count + 1):
            if node in self.wants or node in self.refused:
                continue
            record = self._io._read(f"{_P}want/{target}/{node}")
            if record is None:
                continue
            if node in self.lost:
                self._refuse(node, f"rendezvous at {self.endpoint}: this node ({_name(record)}) was declared lost "
                                   f"(no heartbeat for {self.node_timeout:g} s, or its launcher's connection to node 0 "
                                   f"closed) and the job went on without it; "
                                   f"start its launcher again to join the next round")
                continue
            why = settings_difference(self.endpoint, f"a joining node ({_name(record)})",
                                      self._settings, record.get("settings", {}))
            if node and why is not None:
                self._refuse(node, why)
                continue
            self.wants[node] = record
            self.heard.setdefault(node, (-1, now))
            if node not in self.expected:  # the last call waits for newcomers; a survivor back closes at once
                self.last_change = now

    def _refuse(self, node: int, why: str) -> None:
        self.refused.add(node)
        self._put(f"{_P}refused/{node}", {"description": why})
        print(f"[conveyor] refused a node: {why}", file=sys.stderr, flush=True)

    def _watch(self, now: float) -> None:
        """Beats of the members and of the nodes waiting; one silent for ``node_timeout``, or whose lifeline
        closed, is lost."""
        if self._lifelines is not None:
            self.closed |= self._lifelines.poll()
        for node in sorted((set(self.members) | set(self.wants)) - {0} - self.lost):
            beat = self._io.beat_at(f"{_P}alive/m{node}")
            last, since = self.heard.get(node, (-1, now))
            if beat is not None and beat > last:
                last, since = beat, now
            self.heard[node] = (last, since)
            if now - since > self.node_timeout or node in self.closed:
                self.lost.add(node)
                if self.wants.pop(node, None) is not None:
                    self.last_change = now

    def _ordered(self) -> list[int]:
        """Who wants the round, in rank order: node 0, the last round's survivors as they were, newcomers."""
        old = [n for n in self.members if n in self.wants]
        return old + sorted(n for n in self.wants if n not in old)

    def _collect(self, now: float) -> None:
        have = self._ordered()
        missing = [n for n in self.expected if n not in self.wants and n not in self.lost]
        decision = round_decision(have=len(have), missing=len(missing), span=self.span, now=now,
                                  opened=self.opened, last_change=self.last_change, last_call=self.last_call,
                                  timeout=self.timeout)
        if decision == "fail":
            self._fail(f"rendezvous at {self.endpoint}: round {self.round} has {len(have)} node(s), but --nnodes "
                       f"{self.span} needs at least {self.span.min}; no more joined within {self.timeout:g} s "
                       f"(--timeout). Start `conveyor run --nnodes {self.span} --rdzv {self.endpoint} ...` on more "
                       f"machines, then start the job again (it resumes from its latest checkpoint)")
        elif decision == "close" and 0 in self.wants:
            members = have[:self.span.max]
            attempt = int(self.wants[0]["attempt"])
            nodes = [{k: self.wants[n][k] for k in ("host", "workers", "ps", "ports", "hostname")} for n in members]
            self._put(f"{_P}round/{self.round}", {"members": members, "nodes": nodes, "attempt": attempt})
            self.members, self.collecting, self.wants = members, False, {}
            self._attempt, self._mark = attempt, None

    def _running(self, now: float) -> None:
        gone = [n for n in self.members if n in self.lost]
        if gone:
            why = ("its launcher's connection to node 0 closed (the process is gone)" if set(gone) <= self.closed
                   else f"no heartbeat from the launcher for {self.node_timeout:g} s")
            ranks = ", ".join(str(self.members.index(n)) for n in gone)
            self._regroup(now, f"lost node(s) {ranks} of round {self.round}: {why}; the job goes on without it, "
                               f"with {len(self.members) - len(gone)} node(s) (--nnodes {self.span})")
            return
        waiting = [n for n in self.wants if n not in self.members]
        failed = self._io.failure(self._attempt) is not None
        if failed:
            self._attempt += 1  # that attempt's restart: a waiting node joins there
        if not waiting or len(self.members) >= self.span.max:
            self._mark = None
            self._withdraw()  # the node that waited left: the chief goes on
            return
        self._ask_drain()
        step = self._new_checkpoint(now)
        if failed or step is not None:
            when = "the restart after a failure" if failed else f"checkpoint step {step}"
            names = ", ".join(_name(self.wants[n]) for n in waiting)
            self._regroup(now, f"{len(waiting)} node(s) wait to join ({names}); the job is re-formed at {when}")

    def _new_checkpoint(self, now: float) -> int | None:
        """A checkpoint newer than the one there when a node began to wait (looked at once a second, every tick while
        a drain is asked)."""
        if self._mark is not None and now < self._mark[0]:
            return None
        try:
            step = resume_step(self._checkpoints, verify=False, warn=False)
        except (CheckpointError, OSError):
            step = None
        look = now + (_POLL if self._drain_asked else _CHECKPOINT_LOOK)  # a drain's checkpoint comes soon
        if self._mark is None:
            self._mark = (look, step)
            return None
        self._mark = (look, self._mark[1])
        return step if step is not None and step != self._mark[1] else None

    def _ask_drain(self) -> None:
        """Ask the chief of this round to save after its next step and stop there (train/drain.py): the job then
        re-forms at that checkpoint with no step past it to undo."""
        if not self._drain_asked:
            with contextlib.suppress(OSError):  # (unwritable: the job re-forms at the next periodic checkpoint)
                self._drain.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(self._drain, json.dumps({"round": self.round}).encode())
            self._drain_asked = True

    def _withdraw(self, force: bool = False) -> None:
        if self._drain_asked or force:
            with contextlib.suppress(OSError):
                self._drain.unlink(missing_ok=True)
            self._drain_asked = False

    def _regroup(self, now: float, reason: str) -> None:
        self._drain_asked = False  # (the request names the old round: the chief stays stopped until its SIGTERM)
        self._put(f"{_P}regroup/{self.round}", {"description": reason})
        self.expected = {0} | {n for n in self.members if n not in self.lost}
        self.round += 1
        # no newcomer since: the round closes as soon as every survivor is back (the last call is for newcomers)
        self.collecting, self.opened, self.last_change = True, now, now - self.last_call
        self._put(f"{_P}open", {"round": self.round})

    def _fail(self, reason: str) -> None:
        try:
            self._io.abort(reason)
        except PeerError:
            pass
        self._stop.set()
