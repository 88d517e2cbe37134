"""Which parameter server holds which elements of which parameter: a pure, deterministic placement.

    placement = place([(name, p.shape, p.dtype) for name, p in model.named_parameters()], num_servers=2)
    print(placement.describe())                      # the start-up table: server, pieces, MiB, largest piece
    for piece, view in placement.split("embed.weight", grad):   # views into the flattened tensor
        send(piece.server, piece.key, view)
    flat = placement.join("embed.weight", received)  # {piece.key: tensor} -> the whole flat tensor

Every parameter is flattened and cut into one or more :class:`Piece` (an element range ``[start, stop)``
on one server): tensors over ``chunk_bytes`` are split over every server in equal shares, smaller ones
go whole to the least-loaded server.

Promises: the same list always gives the same placement (no randomness, no dict-order or hash
dependence), and ``to_json()`` carries a fingerprint both sides check; the load per server differs by
at most the largest piece's bytes, so max/min ≤ 1.25 once the average share is at least 5 × the
largest piece. The construction and its proof: docs/ps.md, "Pieces and the optimizer on the
servers".
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DEFAULT_CHUNK_BYTES", "ParamInfo", "Piece", "Placement", "parse_piece_key", "piece_key", "place"]

#: Pieces are at most this big unless the caller says otherwise: large enough that per-message
#: overhead is noise, small enough that a huge tensor spreads over the servers and pipelines.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024

_FORMAT = "conveyor.ps.placement"
_VERSION = 1
_KEY_RE = re.compile(r"^(?P<param>.*)\[(?P<start>\d+):(?P<stop>\d+)\]$", re.DOTALL)


def piece_key(param: str, start: int, stop: int) -> str:
    """The string that names a piece on the wire and in checkpoints: ``"fc.weight[0:4096]"``."""
    return f"{param}[{start}:{stop}]"


def parse_piece_key(key: str) -> tuple[str, int, int]:
    """``"fc.weight[0:4096]"`` -> ``("fc.weight", 0, 4096)``; ``ValueError`` for anything else."""
    match = _KEY_RE.match(key) if isinstance(key, str) else None
    if match is None:
        raise ValueError(f"{key!r} is not a piece key; expected 'PARAM[START:STOP]', e.g. 'fc.weight[0:4096]'")
    return match["param"], int(match["start"]), int(match["stop"])


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened parameter ``param``, held by server ``server``."""

    param: str
    start: int
    stop: int
    server: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def key(self) -> str:
        """Unique within a placement; what messages and checkpoints use to name the piece."""
        return piece_key(self.param, self.start, self.stop)


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A parameter as the placement sees it: name, shape and dtype name (``"float32"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _torch_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def place(named_shapes_dtypes: Iterable[tuple[str, Sequence[int], torch.dtype | str]], num_servers: int,
          chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Placement:
    """Spread parameters ``(name, shape, dtype)`` over ``num_servers`` servers (algorithm: docs/ps.md).

    ``dtype`` is a ``torch.dtype`` or its name (``"float32"``). Which server gets which piece depends
    only on the list's contents, not its order; the placement lists parameters (and their pieces) in
    the order given, and that order is part of the fingerprint, since messages may follow it.
    """
    params = [_param_info(entry) for entry in named_shapes_dtypes]
    num_servers = _positive_int(num_servers, "num_servers", "the number of ps tasks (--ps)")
    chunk_bytes = _positive_int(chunk_bytes, "chunk_bytes", "the largest piece, in bytes (default 4 MiB)")
    _check_unique(params)

    loads = [0] * num_servers
    pieces: list[Piece] = []
    by_size = sorted(params, key=lambda p: (-p.nbytes, p.name))

    # 1. Split what is larger than a chunk, the same number of pieces per server.
    for p in (p for p in by_size if p.nbytes > chunk_bytes):
        chunk_elems = max(1, chunk_bytes // p.itemsize)
        count = min(p.numel, math.ceil(math.ceil(p.numel / chunk_elems) / num_servers) * num_servers)
        small, extra = divmod(p.numel, count)  # the first `extra` pieces are one element larger
        servers = sorted(range(num_servers), key=lambda s: (loads[s], s))
        start = 0
        for i in range(count):
            stop = start + small + (1 if i < extra else 0)
            server = servers[i % num_servers]
            pieces.append(Piece(p.name, start, stop, server))
            loads[server] += (stop - start) * p.itemsize
            start = stop

    # 2. Whole parameters, largest first, each to the least-loaded server.
    for p in (p for p in by_size if p.nbytes <= chunk_bytes):
        server = min(range(num_servers), key=lambda s: (loads[s], s))
        pieces.append(Piece(p.name, 0, p.numel, server))
        loads[server] += p.nbytes

    order = {p.name: i for i, p in enumerate(params)}
    pieces.sort(key=lambda piece: (order[piece.param], piece.start))
    return Placement(params, pieces, num_servers, chunk_bytes)


class Placement:
    """The result of :func:`place`: parameters, their pieces, and where each piece lives.

    Constructed directly (or by :meth:`from_json`) it checks its invariants: every element of every
    parameter lies in exactly one piece, pieces are listed in parameter order then by ``start``, and
    every server index is in ``range(num_servers)``.
    """

    def __init__(self, params: Sequence[ParamInfo], pieces: Sequence[Piece], num_servers: int,
                 chunk_bytes: int) -> None:
        self.params: tuple[ParamInfo, ...] = tuple(params)
        self.pieces: tuple[Piece, ...] = tuple(pieces)
        self.num_servers = _positive_int(num_servers, "num_servers", "the number of ps tasks (--ps)")
        self.chunk_bytes = _positive_int(chunk_bytes, "chunk_bytes", "the largest piece, in bytes")
        _check_unique(self.params)
        self._param = {p.name: p for p in self.params}
        self._of_param: dict[str, list[Piece]] = {p.name: [] for p in self.params}
        self._by_key: dict[str, Piece] = {}
        for piece in self.pieces:
            if piece.param not in self._param:
                raise ValueError(f"piece {piece.key} belongs to no parameter of the placement")
            if not 0 <= piece.server < self.num_servers:
                raise ValueError(f"piece {piece.key} is on server {piece.server}; servers are "
                                 f"0..{self.num_servers - 1}")
            self._of_param[piece.param].append(piece)
            self._by_key[piece.key] = piece
        for p in self.params:
            own, expected = self._of_param[p.name], 0
            for piece in own:
                if piece.start != expected or piece.stop < piece.start or (piece.stop == piece.start and p.numel):
                    raise ValueError(f"the pieces of {p.name!r} do not tile its {p.numel} elements exactly once "
                                     f"in order: {[x.key for x in own]}")
                expected = piece.stop
            if expected != p.numel or not own:
                raise ValueError(f"the pieces of {p.name!r} cover {expected} of its {p.numel} elements: "
                                 f"{[x.key for x in own]}")
        listed = [(piece.param, piece.start) for piece in self.pieces]
        if listed != [(p.name, x.start) for p in self.params for x in self._of_param[p.name]]:
            raise ValueError("pieces must be listed in parameter order, then by start")
        self.fingerprint = _fingerprint(self._body())

    # -- queries ----------------------------------------------------------------------------------

    def param(self, name: str) -> ParamInfo:
        """The parameter ``name``; ``KeyError`` naming a few known ones otherwise."""
        try:
            return self._param[name]
        except KeyError:
            known = ", ".join(repr(n) for n in list(self._param)[:5])
            raise KeyError(f"{name!r} is not a parameter of this placement (it has {len(self._param)}: "
                           f"{known}{', ...' if len(self._param) > 5 else ''})") from None

    def piece(self, key: str) -> Piece:
        """The piece named ``key`` (``"fc.weight[0:4096]"``)."""
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"no piece {key!r} in this placement (fingerprint {self.fingerprint})") from None

    def pieces_of(self, name: str) -> list[Piece]:
        """The pieces of parameter ``name``, by ``start``."""
        self.param(name)
        return list(self._of_param[name])

    def pieces_for(self, server: int) -> list[Piece]:
        """The pieces server ``server`` holds, in parameter order then by ``start``."""
        if not isinstance(server, int) or not 0 <= server < self.num_servers:
            raise ValueError(f"server = {server!r}; servers are 0..{self.num_servers - 1}")
        return [p for p in self.pieces if p.server == server]

    def nbytes(self, piece: Piece) -> int:
        return piece.numel * self._param[piece.param].itemsize

    def bytes_per_server(self) -> list[int]:
        """Bytes of parameters (one copy, no optimizer state) held by each server, by server index."""
        loads = [0] * self.num_servers
        for piece in self.pieces:
            loads[piece.server] += self.nbytes(piece)
        return loads

    def verify(self, fingerprint: str, *, peer: str = "the peer") -> None:
        """Raise unless ``fingerprint`` is this placement's: both sides must cut the parameters the same way."""
        if fingerprint != self.fingerprint:
            raise ValueError(f"{peer} uses parameter placement {fingerprint!r}, this process {self.fingerprint!r}: "
                             f"they would update different elements. Start every task from the same model "
                             f"definition, the same number of ps tasks and the same chunk size")

    # -- tensors ----------------------------------------------------------------------------------

    def split(self, name: str, tensor: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        """``(piece, values)`` for each piece of ``name``, in order; values are views of the flattened tensor.

        A non-contiguous ``tensor`` is copied once when flattened, so then the views are of that copy.
        """
        info = self.param(name)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != info.numel:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"split({name!r}): got {got}; the placement has shape {info.shape}")
        flat = tensor.reshape(-1)
        return [(piece, flat[piece.start:piece.stop]) for piece in self._of_param[name]]

    def join(self, name: str, parts: Mapping[Any, torch.Tensor] | Iterable[tuple[Any, torch.Tensor]]) -> torch.Tensor:
        """The flat tensor of ``name`` from its pieces' values (keyed by :class:`Piece` or piece key).

        Every piece of ``name`` must appear exactly once, with the right number of elements; parts of
        other parameters are refused, so a mix-up shows here rather than as a wrongly trained model.
        """
        info = self.param(name)
        items = parts.items() if isinstance(parts, Mapping) else parts
        got: dict[str, torch.Tensor] = {}
        for key, value in items:
            key = key.key if isinstance(key, Piece) else key
            piece = self._by_key.get(key)
            if piece is None or piece.param != name:
                raise ValueError(f"join({name!r}): {key!r} is not a piece of {name!r}")
            if key in got:
                raise ValueError(f"join({name!r}): piece {key} given twice")
            if value.numel() != piece.numel:
                raise ValueError(f"join({name!r}): piece {key} has {piece.numel} elements, got {value.numel()}")
            got[key] = value.reshape(-1)
        missing = [p.key for p in self._of_param[name] if p.key not in got]
        if missing:
            raise ValueError(f"join({name!r}): missing piece(s) {missing} of {info.numel} elements")
        return torch.cat([got[p.key] for p in self._of_param[name]])

    # -- text and JSON ----------------------------------------------------------------------------

    def describe(self) -> str:
        """A table for the start-up log: per server, the number of pieces, MiB, and the largest piece."""
        loads = self.bytes_per_server()
        total = sum(loads)
        lines = [f"parameter placement {self.fingerprint}: {len(self.params)} parameters, {_size(total)} in "
                 f"{len(self.pieces)} pieces over {self.num_servers} server(s), chunk {_size(self.chunk_bytes)}",
                 f"{'server':<8}{'pieces':>7}{'MiB':>11}  largest piece"]
        for server in range(self.num_servers):
            own = self.pieces_for(server)
            largest = max(own, key=self.nbytes, default=None)  # the first of equals
            big = f"{largest.key} ({_size(self.nbytes(largest))})" if largest is not None else "-"
            lines.append(f"{'ps:' + str(server):<8}{len(own):>7}{loads[server] / 2**20:>11.2f}  {big}")
        if min(loads) > 0:
            lines.append(f"balance: max/min = {max(loads) / min(loads):.3f}")
        elif total > 0:
            idle = [f"ps:{s}" for s, load in enumerate(loads) if load == 0]
            lines.append(f"balance: {', '.join(idle)} hold(s) nothing: fewer pieces than servers (a small model)")
        return "\n".join(lines)

    def _body(self) -> dict[str, Any]:
        index = {p.name: i for i, p in enumerate(self.params)}
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "num_servers": self.num_servers,
            "chunk_bytes": self.chunk_bytes,
            "params": [[p.name, list(p.shape), p.dtype] for p in self.params],
            "pieces": [[index[x.param], x.start, x.stop, x.server] for x in self.pieces],
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, with ``fingerprint`` (sha256 of the rest, canonical JSON, 16 hex digits)."""
        return {**self._body(), "fingerprint": self.fingerprint}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any]) -> Placement:
        """Inverse of :meth:`to_json` (also takes the dict); refuses another format, version or fingerprint."""
        obj = json.loads(data) if isinstance(data, (str, bytes)) else dict(data)
        if obj.get("format") != _FORMAT or obj.get("version") != _VERSION:
            raise ValueError(f"not a conveyor placement of version {_VERSION}: format={obj.get('format')!r}, "
                             f"version={obj.get('version')!r}")
        try:
            params = [ParamInfo(str(name), tuple(int(n) for n in shape), _dtype_name(dtype))
                      for name, shape, dtype in obj["params"]]
            pieces = [Piece(params[i].name, int(start), int(stop), int(server))
                      for i, start, stop, server in obj["pieces"]]
            placement = cls(params, pieces, obj["num_servers"], obj["chunk_bytes"])
        except (KeyError, TypeError, IndexError) as err:
            raise ValueError(f"malformed placement JSON ({type(err).__name__}: {err})") from None
        if obj.get("fingerprint") != placement.fingerprint:
            raise ValueError(f"placement fingerprint {obj.get('fingerprint')!r} does not match its contents "
                             f"({placement.fingerprint!r}): the JSON was altered or damaged")
        return placement

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and self._body() == other._body()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Placement({len(self.params)} params, {len(self.pieces)} pieces, num_servers={self.num_servers}, "
                f"fingerprint={self.fingerprint!r})")


# -- helpers --------------------------------------------------------------------------------------


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return dtype


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = str(dtype).removeprefix("torch.")
    _torch_dtype(name)
    return name


def _param_info(entry: Any) -> ParamInfo:
    try:
        name, shape, dtype = entry
    except (TypeError, ValueError):
        raise ValueError(f"expected (name, shape, dtype), got {entry!r}") from None
    if not isinstance(name, str) or not name:
        raise ValueError(f"parameter name {name!r}: expected a non-empty string")
    dims = tuple(int(n) for n in shape)
    if any(n < 0 for n in dims):
        raise ValueError(f"parameter {name!r}: shape {dims} has a negative dimension")
    return ParamInfo(name, dims, _dtype_name(dtype))


def _check_unique(params: Sequence[ParamInfo]) -> None:
    seen: set[str] = set()
    for p in params:
        if p.name in seen:
            raise ValueError(f"parameter {p.name!r} is listed twice; names must be unique (named_parameters())")
        seen.add(p.name)


def _positive_int(value: Any, name: str, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} = {value!r}: expected a whole number >= 1 ({meaning})")
    return value


def _fingerprint(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"
