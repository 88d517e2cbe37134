"""The parameter-server protocol: one class per request and per reply, each building and checking its header.

    kind, header, tensors = Push(rank=0, step=3, read=2, keys=["w[0:4]"], grads=[g]).encode()
    request = read_request(message.kind, message.header, message.torch_tensors(), num_workers=2)
    reply = read_reply(message, CommitReply, what="commit")

Requests go from a worker to a ps task: ``init``, ``push``, ``commit``, ``pull``, ``stats``, ``state``,
``load_state``, ``save``, ``restore``, ``position``, ``positions``, ``rejoin``, ``meet``, ``ping``, ``done``; each
class says its fields, and the table of requests, replies and their fields is in docs/ps.md, "The
parameter-server protocol".

Promises: ``from_header`` refuses a header with a missing field, a field of the wrong type or out of
range, or tensors that do not match what the header lists, with one :class:`ProtocolError` naming the
message and the field (the server answers it with an ``error`` reply, raised on the worker as
:class:`~conveyor.comm.transport.RemoteError`). Ranks are checked against the job's number of workers
where the reader knows it; steps, versions and ranks are whole numbers >= 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from conveyor.comm.framing import Message
from conveyor.errors import ConveyorError
from conveyor.strategies.ps.packing import pack, unpack

__all__ = [
    "REQUESTS", "CommitReply", "Commit", "Done", "Init", "InitReply", "LoadState", "OkReply", "ParamsReply",
    "MAX_POSITION_BYTES", "Meet", "Ping", "Position", "Positions", "PositionsReply", "ProtocolError", "Pull", "Push",
    "Refused",
    "Rejoin", "RejoinReply", "Restore", "Save", "SaveReply", "State", "StateReply", "Stats", "StatsReply", "WaitReply",
    "read_reply", "read_request",
]


class ProtocolError(ConveyorError, ValueError):
    """A ps message whose header or tensors are not what its kind requires; names the message and the field."""

    def __init__(self, kind: str, field_name: str, problem: str) -> None:
        self.kind = kind
        self.field = field_name
        super().__init__(f"ps {kind} message: {field_name} {problem}")


class Refused(ProtocolError):
    """A well-formed request the server will not keep: it names pieces the server does not hold, too many
    pieces, or a step outside the worker's window. ``reason`` is what the server counts it under."""

    def __init__(self, kind: str, field_name: str, problem: str, *, reason: str) -> None:
        super().__init__(kind, field_name, problem)
        self.reason = reason


class _Fields:
    """Reads one message's header fields, refusing a wrong type or range with a :class:`ProtocolError`."""

    def __init__(self, label: str, header: Any, num_workers: int | None, max_pieces: int | None = None) -> None:
        if header is None:
            header = {}
        if not isinstance(header, dict):
            raise ProtocolError(label, "header", f"is a {type(header).__name__}; expected a map")
        self.label, self.header, self.num_workers = label, header, num_workers
        self.max_pieces = max_pieces  # the most pieces a push may name (the pieces the server holds)

    def fail(self, name: str, problem: str) -> ProtocolError:
        return ProtocolError(self.label, name, problem)

    def _get(self, name: str, kinds: type | tuple[type, ...], expected: str, optional: bool) -> Any:
        value = self.header.get(name)
        if value is None:
            if optional:
                return None
            raise self.fail(name, f"is missing; expected {expected}")
        if isinstance(value, bool) or not isinstance(value, kinds):  # bool is an int to Python, not to us
            raise self.fail(name, f"is a {type(value).__name__} ({str(value)[:80]}); expected {expected}")
        return value

    def whole(self, name: str, *, optional: bool = False) -> int | None:
        value = self._get(name, int, "a whole number >= 0", optional)
        if value is not None and value < 0:
            raise self.fail(name, f"is {value}; expected a whole number >= 0")
        return value

    def rank(self, *, optional: bool = False) -> int | None:
        rank = self.whole("rank", optional=optional)
        if rank is not None and self.num_workers is not None and rank >= self.num_workers:
            raise self.fail("rank", f"is {rank}, outside 0..{self.num_workers - 1} (the job's workers)")
        return rank

    def text(self, name: str, *, optional: bool = False) -> str | None:
        return self._get(name, str, "a string", optional)

    def table(self, name: str) -> dict[str, Any]:
        return self._get(name, dict, "a map", False)

    def items(self, name: str, kind: type, expected: str, *, optional: bool = False) -> list[Any] | None:
        """A list whose every item is a ``kind`` (bools are not whole numbers)."""
        values = self._get(name, (list, tuple), f"a list of {expected}", optional)
        if values is None:
            return None
        for i, item in enumerate(values):
            if not isinstance(item, kind) or (isinstance(item, bool) and kind is not bool) or (
                    kind is int and item < 0):
                raise self.fail(name, f"item {i} is {str(item)[:80]!r}; expected {expected}")
        return list(values)

    def counts(self, name: str) -> dict[str, int]:
        """A map of names to whole numbers (counters)."""
        table = self.table(name)
        for key, value in table.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise self.fail(name, f"entry {str(key)[:80]!r}: {str(value)[:80]!r}; expected a name and a "
                                      f"whole number >= 0")
        return table

    def tensors(self, name: str, names: Sequence[Any], tensors: Sequence[Any]) -> list[Any]:
        """``tensors``, checked to be one tensor per entry of the header's list ``name``."""
        if len(names) != len(tensors):
            raise self.fail(name, f"lists {len(names)} pieces but the message carries {len(tensors)} tensors")
        for i, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise self.fail("tensors", f"item {i} is a {type(tensor).__name__}; expected a torch.Tensor")
        return list(tensors)

    def named(self, name: str, tensors: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The header's list ``name`` (distinct strings) paired with the tensors, in order."""
        names = self.items(name, str, "strings")
        if len(set(names)) != len(names):
            raise self.fail(name, "lists a name twice")
        return dict(zip(names, self.tensors(name, names, tensors), strict=True))


class _Message:
    """One kind of ps message. Subclasses are dataclasses whose fields are the header's (see ``to_header``)."""

    KIND: ClassVar[str]  # the kind on the wire
    LABEL: ClassVar[str]  # how errors name it
    TENSORS: ClassVar[str | None] = None  # the field holding the message's tensors, if any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "LABEL" not in cls.__dict__ and "KIND" in cls.__dict__:
            cls.LABEL = repr(cls.KIND)

    def to_header(self) -> dict[str, Any]:
        """The header: every field but the tensors, in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if f.name != self.TENSORS}

    def tensors(self) -> list[Any]:
        if self.TENSORS is None:
            return []
        value = getattr(self, self.TENSORS)
        return list(value.values() if isinstance(value, dict) else value)

    def encode(self) -> tuple[str, dict[str, Any], list[Any]]:
        """``(kind, header, tensors)`` for :meth:`conveyor.comm.transport.Client.send` or a handler's return."""
        return self.KIND, self.to_header(), self.tensors()

    @classmethod
    def from_header(cls, header: Any, tensors: Sequence[Any] = (), *, num_workers: int | None = None,
                    max_pieces: int | None = None) -> Any:
        """The message from a received header and its tensors; :class:`ProtocolError` when malformed
        (:class:`Refused` for a push naming more than ``max_pieces`` pieces, checked before anything else)."""
        fields = _Fields(cls.LABEL, header, num_workers, max_pieces)
        if cls.TENSORS is None and len(tensors):
            raise fields.fail("tensors", f"are {len(tensors)}; this message carries none")
        return cls._read(fields, list(tensors))

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> Any:
        return cls()  # a message without fields; the others read theirs


class _Packed(_Message):
    """A message with one flat piece per key, whose pieces may travel packed (:mod:`.packing`): then the
    header's ``sizes`` lists each piece's element count, and the frames hold the pieces back to back."""

    def encode(self) -> tuple[str, dict[str, Any], list[Any]]:
        kind, header, values = super().encode()
        frames, sizes = pack(values)
        return kind, header if sizes is None else {**header, "sizes": sizes}, frames


def _pieces(f: _Fields, keys: list[str], tensors: list[Any]) -> list[Any]:
    """One value per key: the tensors as they are, or cut from packed frames as the header's ``sizes`` says."""
    sizes = f.items("sizes", int, "whole numbers >= 1", optional=True)
    if sizes is None:
        return f.tensors("keys", keys, tensors)
    if len(sizes) != len(keys):
        raise f.fail("sizes", f"lists {len(sizes)} pieces for {len(keys)} keys")
    try:
        return unpack(sizes, tensors)
    except ValueError as exc:
        raise f.fail("sizes", str(exc)) from None


# -- requests ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Init(_Message):
    KIND = "init"
    TENSORS = "values"
    fingerprint: str
    rank: int
    spec: str | None = None  # worker 0's optimizer (OptimizerSpec JSON); with it, the pieces and their values
    keys: list[str] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)

    def to_header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"fingerprint": self.fingerprint, "rank": self.rank}
        if self.spec is not None:
            header.update(spec=self.spec, keys=list(self.keys))
        return header

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> Init:
        spec = f.text("spec", optional=True)
        keys = f.items("keys", str, "piece keys") if spec is not None else []
        return cls(f.text("fingerprint"), f.rank(), spec, keys, f.tensors("keys", keys, tensors))


@dataclass(frozen=True, eq=False)
class Push(_Packed):
    KIND = "push"
    TENSORS = "grads"
    rank: int
    step: int
    read: int  # the version the gradient was computed on (absent on the wire: ``step``)
    keys: list[str]
    grads: list[Any]

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> Push:
        _check_count(f, "keys")
        step = f.whole("step")
        keys = f.items("keys", str, "piece keys")
        return cls(f.rank(), step, _read_version(f, step), keys, _pieces(f, keys, tensors))


#: The largest data position a commit may carry (a worker restarted alone resumes from it; docs/ps.md).
MAX_POSITION_BYTES = 1 << 20


@dataclass(frozen=True)
class Commit(_Message):
    KIND = "commit"
    TENSORS = "position"
    rank: int
    step: int
    read: int
    hyper: list[dict[str, Any]] | None = None  # each group's changed hyperparameters, when they changed
    plan: int | None = None  # the total step count this worker announces it stops at
    position: bytes | None = None  # the data position after this step's batch, when it changed (one uint8 tensor)

    def tensors(self) -> list[Any]:
        return [] if self.position is None else [_uint8(self.position)]

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> Commit:
        step = f.whole("step")
        hyper = f.items("hyper", dict, "maps", optional=True)
        _check_finite_hyper(f, hyper)
        return cls(f.rank(), step, _read_version(f, step), hyper, f.whole("plan", optional=True),
                   _read_position(f, tensors))


def _read_position(f: _Fields, tensors: list[Any]) -> bytes | None:
    """A commit's data position: no tensor, or one 1-d uint8 tensor of at most ``MAX_POSITION_BYTES``."""
    if not tensors:
        return None
    if len(tensors) != 1 or not _is_bytes(tensors[0]):
        raise f.fail("tensors", "are not one 1-d uint8 tensor (the data position's bytes)")
    if tensors[0].numel() > MAX_POSITION_BYTES:
        raise Refused(f.label, "tensors", f"carry a data position of {tensors[0].numel()} bytes, over "
                                          f"{MAX_POSITION_BYTES}: a worker restarted alone resumes from it, so it must "
                                          f"stay small (an iterator state without the data itself)",
                      reason="position_too_large")
    return tensors[0].numpy().tobytes()


def _check_finite_hyper(f: _Fields, hyper: list[dict[str, Any]] | None) -> None:
    """A NaN or infinite hyperparameter (``lr = NaN``) would turn every parameter it touches into NaN: refused."""
    for i, group in enumerate(hyper or ()):
        for key, value in group.items():
            numbers = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
                raise f.fail("hyper", f"group {i}: {str(key)[:80]} = {value!r}; expected a finite number (a "
                                      f"non-finite hyperparameter would make every parameter NaN)")


def _check_count(f: _Fields, name: str) -> None:
    """Refuse a list ``name`` longer than ``f.max_pieces`` before reading (or unpacking) any of it."""
    values = f.header.get(name)
    if f.max_pieces is not None and isinstance(values, (list, tuple)) and len(values) > f.max_pieces:
        raise Refused(f.label, name, f"lists {len(values)} pieces; this server holds {f.max_pieces}, and a push "
                                     f"names only pieces it holds", reason="too_many_pieces")


def _read_version(f: _Fields, step: int) -> int:
    read = f.whole("read", optional=True)
    return step if read is None else read


@dataclass(frozen=True)
class Pull(_Message):
    KIND = "pull"
    rank: int
    step: int
    hold: int = 0  # ms the server may keep the pull before answering 'wait' (0, or absent: answer at once)

    def to_header(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, **({"hold": self.hold} if self.hold else {})}

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> Pull:
        return cls(f.rank(), f.whole("step"), f.whole("hold", optional=True) or 0)


@dataclass(frozen=True)
class _FromRank(_Message):
    """A request with nothing but the asking worker's rank (optional where ``RANK_OPTIONAL``).

    Its subclasses (and :class:`_ShardRequest`'s) add only class constants, so they need no
    ``@dataclass`` of their own: the fields, ``__init__`` and ``__repr__`` are inherited."""

    RANK_OPTIONAL: ClassVar[bool] = False
    rank: int | None = None

    def to_header(self) -> dict[str, Any]:
        return {} if self.rank is None else {"rank": self.rank}

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> Any:
        return cls(f.rank(optional=cls.RANK_OPTIONAL))


class Stats(_FromRank):
    KIND = "stats"
    RANK_OPTIONAL = True


class State(_FromRank):
    KIND = "state"
    RANK_OPTIONAL = True


class Positions(_FromRank):
    KIND = "positions"


class Done(_FromRank):
    KIND = "done"


class Rejoin(_FromRank):
    """A replacement of worker ``rank`` (restarted alone) asks where that worker stands on this server."""

    KIND = "rejoin"


@dataclass(frozen=True)
class Ping(_Message):
    KIND = "ping"


@dataclass(frozen=True, eq=False)
class LoadState(_Message):
    KIND = "load_state"
    TENSORS = "named"
    rank: int
    meta: dict[str, Any]
    named: dict[str, Any]  # name -> tensor; the header lists the names

    def to_header(self) -> dict[str, Any]:
        return {"rank": self.rank, "meta": self.meta, "names": list(self.named)}

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> LoadState:
        return cls(f.rank(), f.table("meta"), f.named("names", tensors))


@dataclass(frozen=True)
class _ShardRequest(_Message):
    rank: int
    step: int
    root: str  # the checkpoint folder (its path as the ps task sees it)

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> Any:
        return cls(f.rank(), f.whole("step"), f.text("root"))


class Save(_ShardRequest):
    KIND = "save"


class Restore(_ShardRequest):
    KIND = "restore"


@dataclass(frozen=True)
class Position(_Message):
    KIND = "position"
    TENSORS = "data"
    rank: int
    data: bytes  # one worker's data position (JSON), one 1-d uint8 tensor on the wire

    def to_header(self) -> dict[str, Any]:
        return {"rank": self.rank}

    def tensors(self) -> list[Any]:
        return [_uint8(self.data)]

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> Position:
        rank = f.rank()
        if len(tensors) != 1 or not _is_bytes(tensors[0]):
            raise f.fail("tensors", "are not exactly one 1-d uint8 tensor (the position's bytes)")
        return cls(rank, tensors[0].numpy().tobytes())


@dataclass(frozen=True)
class Meet(Position):
    """Worker ``rank``'s ``data`` for meeting ``key`` on ps:0: the workers' collectives where they run apart
    (ps-async/ssp, after training, and a worker restarted alone that joined no process group; ``meetings.py``).
    Answered with every worker's data (a ``positions`` reply) once all are in, else ``wait``."""

    KIND = "meet"
    key: int = 0

    def to_header(self) -> dict[str, Any]:
        return {"rank": self.rank, "key": self.key}

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> Meet:
        position = Position._read(f, tensors)
        return cls(position.rank, position.data, f.whole("key"))


def _uint8(data: bytes) -> torch.Tensor:
    # torch.frombuffer refuses an empty buffer.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _is_bytes(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8 and tensor.dim() == 1


REQUESTS: dict[str, type[_Message]] = {cls.KIND: cls for cls in (
    Init, Push, Commit, Pull, Stats, State, LoadState, Save, Restore, Position, Positions, Rejoin, Meet, Ping,
    Done)}


def read_request(kind: str, header: Any, tensors: Sequence[Any], *, num_workers: int | None = None,
                 max_pieces: int | None = None) -> Any:
    """The typed request for a received message; :class:`ProtocolError` for an unknown kind or a bad field,
    :class:`Refused` for a push naming more than ``max_pieces`` pieces (None: no limit)."""
    cls = REQUESTS.get(kind)
    if cls is None:
        raise ProtocolError(repr(kind), "kind", f"is not a ps request; expected one of {', '.join(REQUESTS)}")
    return cls.from_header(header, tensors, num_workers=num_workers, max_pieces=max_pieces)


# -- replies -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OkReply(_Message):
    KIND = "ok"
    LABEL = "'ok' reply"


@dataclass(frozen=True)
class WaitReply(_Message):
    """Ask again: the update rule (or worker 0's missing ``init``) does not allow an answer yet."""

    KIND = "wait"
    LABEL = "'wait' reply"
    version: int | None = None

    def to_header(self) -> dict[str, Any]:
        return {} if self.version is None else {"version": self.version}

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> WaitReply:
        return cls(f.whole("version", optional=True))


@dataclass(frozen=True)
class InitReply(_Message):
    KIND = "ok"
    LABEL = "'init' reply"
    version: int

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> InitReply:
        return cls(f.whole("version"))


@dataclass(frozen=True)
class CommitReply(_Message):
    KIND = "ok"
    LABEL = "'commit' reply"
    version: int
    total: int  # steps committed by all workers together
    plan: int | None  # the largest total a worker announced it stops at

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> CommitReply:
        return cls(f.whole("version"), f.whole("total"), f.whole("plan", optional=True))


@dataclass(frozen=True)
class SaveReply(_Message):
    KIND = "ok"
    LABEL = "'save' reply"
    parts: list[str]  # the files written into the checkpoint step

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> SaveReply:
        return cls(f.items("parts", str, "file names"))


@dataclass(frozen=True, eq=False)
class ParamsReply(_Packed):
    KIND = "params"
    LABEL = "'params' reply"
    TENSORS = "values"
    version: int  # what the values were read at (the ``read`` of the worker's next push and commit)
    keys: list[str]
    values: list[Any]
    held: int = 0  # microseconds the server kept the pull until it could answer (absent: 0)

    def to_header(self) -> dict[str, Any]:
        return {"version": self.version, "keys": self.keys, **({"held": self.held} if self.held else {})}

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> ParamsReply:
        keys = f.items("keys", str, "piece keys")
        return cls(f.whole("version"), keys, _pieces(f, keys, tensors), f.whole("held", optional=True) or 0)


@dataclass(frozen=True)
class StatsReply(_Message):
    """A server's counters; ``staleness`` is the histogram ``{str(step - read): count}``."""

    KIND = "stats"
    LABEL = "'stats' reply"
    name: str
    mode: str
    version: int
    clock: list[int]  # steps committed, per worker
    staleness: dict[str, int]
    counters: dict[str, int]
    dropped: int
    dropped_by_reason: dict[str, int]
    pieces: int

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> StatsReply:
        staleness = f.counts("staleness")
        if not all(k.isascii() and k.isdigit() for k in staleness):
            raise f.fail("staleness", "has a key that is not a whole number")
        return cls(f.text("name"), f.text("mode"), f.whole("version"), f.items("clock", int, "whole numbers >= 0"),
                   staleness, f.counts("counters"), f.whole("dropped"), f.counts("dropped_by_reason"),
                   f.whole("pieces"))


@dataclass(frozen=True, eq=False)
class StateReply(_Message):
    """A server's pieces and optimizer state: ``meta`` (JSON) and ``named`` (name -> tensor)."""

    KIND = "state"
    LABEL = "'state' reply"
    TENSORS = "named"
    meta: dict[str, Any]
    named: dict[str, Any]

    def to_header(self) -> dict[str, Any]:
        return {"meta": self.meta, "names": list(self.named)}

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> StateReply:
        return cls(f.table("meta"), f.named("names", tensors))


@dataclass(frozen=True, eq=False)
class PositionsReply(_Message):
    KIND = "positions"
    LABEL = "'positions' reply"
    TENSORS = "found"
    found: dict[int, bytes]  # rank -> that worker's newest data position

    def to_header(self) -> dict[str, Any]:
        return {"ranks": sorted(self.found)}

    def tensors(self) -> list[Any]:
        return [_uint8(self.found[r]) for r in sorted(self.found)]

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> PositionsReply:
        ranks = f.items("ranks", int, "ranks")
        tensors = f.tensors("ranks", ranks, tensors)
        if f.num_workers is not None and any(r >= f.num_workers for r in ranks):
            raise f.fail("ranks", f"lists a rank outside 0..{f.num_workers - 1} (the job's workers)")
        if not all(_is_bytes(t) for t in tensors):
            raise f.fail("tensors", "are not all 1-d uint8 tensors (the positions' bytes)")
        return cls({r: t.numpy().tobytes() for r, t in zip(ranks, tensors, strict=True)})


@dataclass(frozen=True, eq=False)
class RejoinReply(_Message):
    """Where a worker stands on one server: ``clock`` steps of it applied, and the data position its newest
    applied commit carried (None: it sent none)."""

    KIND = "rejoin"
    LABEL = "'rejoin' reply"
    TENSORS = "position"
    clock: int
    position: bytes | None = None

    def tensors(self) -> list[Any]:
        return [] if self.position is None else [_uint8(self.position)]

    @classmethod
    def _read(cls, f: _Fields, tensors: list[Any]) -> RejoinReply:
        return cls(f.whole("clock"), _read_position(f, tensors))


def read_reply(message: Message, *expected: type[_Message], what: str, num_workers: int | None = None) -> Any:
    """The reply ``message`` as the first of ``expected`` of its kind; a ``RuntimeError`` for another kind."""
    for cls in expected:
        if cls.KIND == message.kind:
            return cls.from_header(message.header, message.torch_tensors(), num_workers=num_workers)
    raise RuntimeError(f"unexpected {message.kind!r} reply to a {what} request")
