"""Parameter-server messages: a small msgpack header, raw tensor frames, and an HMAC-SHA256 tag.

    frames = encode("push", {"step": 7}, [grad0, grad1], secret=key, sender=sender_id("worker:0"),
                    seq=next_seq(), recipient="ps:1")
    message = decode(frames, secret=key, replay_guard=guard, recipient="ps:1")   # or BadMessage(reason)
    message.tensors[0]          # a numpy array on the received buffer, no copy

One message is ``2 + n`` frames: a msgpack header, the tensors' raw bytes (never concatenated, never
pickled), and a trailer of one GMAC tag per tensor frame plus an HMAC-SHA256 tag over the header, the
frame lengths and those tags. :func:`decode` authenticates before it parses anything and rejects
everything else with a :class:`BadMessage` whose ``reason`` (``frame_count``, ``header_size``,
``signature``, ``header``, ``version``, ``dtype``, ``shape``, ``recipient``, ``stale``, ``replay``) the
transport counts drops by. Senders must be unique across restarts: :func:`sender_id` adds a
per-process nonce, :func:`next_seq` counts per process. ``bfloat16`` travels as its ``uint16`` bit
pattern; torch is imported only by the two torch helpers. The wire format, the reasons for two MACs and
each rejection reason: ``docs/ps.md``, "Message framing and authentication".
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import math
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from conveyor.errors import ConveyorError

__all__ = [
    "ALLOWED_DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_TRAILER_BYTES",
    "REASONS",
    "RESERVED_KEYS",
    "VERSION",
    "BadMessage",
    "Wire",
    "as_wire",
    "check_secret",
    "Message",
    "ReplayGuard",
    "decode",
    "encode",
    "from_torch",
    "next_seq",
    "sender_id",
    "sender_role",
    "to_torch",
]

VERSION = 2
MAX_HEADER_BYTES = 1 << 20
MAX_DIMS = 32
TAG_BYTES = 32  # SHA-256
FRAME_TAG_BYTES = 16  # GMAC
_DOMAIN = b"conveyor/comm/framing/v2\x00"  # ties the tag to this format; a future version signs differently
_FRAME_KEY_CONTEXT = b"conveyor/comm/framing/v2 GMAC key of "
_NONCE = struct.Struct("<QI")  # (seq, frame index): 12 bytes, unique per sender key
_U64 = struct.Struct("<Q")

# Wire name -> little-endian numpy dtype. bfloat16 travels as its 16-bit pattern.
ALLOWED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
        "float16": "<f2", "float32": "<f4", "float64": "<f8", "bfloat16": "<u2",
        "int8": "i1", "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint8": "u1", "bool": "?",
    }.items()
}
RESERVED_KEYS = frozenset({"v", "kind", "sender", "seq", "ts", "tensors", "to", "re", "part"})
MAX_PARTS = 1 << 20
#: The largest trailer a message can have: a tensor's entry in the header takes at least 8 bytes of msgpack
#: (``[b"bool", [], 1]``), so at most ``MAX_HEADER_BYTES // 8`` tensors fit in one message.
MAX_TRAILER_BYTES = TAG_BYTES + FRAME_TAG_BYTES * (MAX_HEADER_BYTES // 8)
REASONS = ("frame_count", "header_size", "signature", "header", "version", "dtype", "shape", "recipient",
           "stale", "replay")


class BadMessage(ConveyorError, ValueError):
    """A message that must be dropped. ``reason`` is one of :data:`REASONS`; ``detail`` says more."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True, eq=False)
class Message:
    """A decoded, authenticated message.

    ``tensors`` are numpy arrays viewing the received frames (writable when the frames are; a frame whose
    address is not aligned for its dtype is copied, which only happens to small frames). ``dtypes`` holds
    the wire names: ``"bfloat16"`` where the array is the ``uint16`` bit pattern. ``header`` holds the
    sender's own fields only.
    """

    kind: str
    header: dict[str, Any]
    tensors: list[np.ndarray]
    sender: str
    seq: int
    ts: float
    dtypes: list[str] = field(default_factory=list)
    recipient: str | None = None
    reply_to: int | None = None
    part: tuple[int, int, int] | None = None  # (index, count, seq of part 0) of a split message

    def torch_tensors(self) -> list[Any]:
        """The tensors as ``torch.Tensor``s sharing memory with the arrays (bfloat16 restored)."""
        return [to_torch(array, dtype) for array, dtype in zip(self.tensors, self.dtypes, strict=True)]


# --------------------------------------------------------------------------------------------- senders


class _ProcessIdentity:
    """A random nonce and a sequence counter, both fresh in every process (including forked children)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.nonce = secrets.token_hex(8)
        self.counter = itertools.count(1)
        self.lock = threading.Lock()


_IDENTITY = _ProcessIdentity()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_IDENTITY.reset)  # a forked child must not reuse its parent's seqs


def sender_id(role: str) -> str:
    """``"worker:0"`` → ``"worker:0#<16 hex digits>"``: the role plus this process's random nonce.

    A restarted task gets a new nonce, so the receivers' replay windows for the old process do not reject
    it, and the old process's messages cannot be replayed as the new one's.
    """
    if not isinstance(role, str) or not role or "#" in role:
        raise ValueError(f"sender role must be a non-empty string without '#', e.g. 'worker:0'; got {role!r}")
    return f"{role}#{_IDENTITY.nonce}"


def next_seq() -> int:
    """The next message number of this process (1, 2, ...), unique for every :func:`sender_id` it makes."""
    with _IDENTITY.lock:
        return next(_IDENTITY.counter)


def sender_role(sender: str) -> str:
    """``"ps:1#ab12..."`` → ``"ps:1"``."""
    return sender.split("#", 1)[0]


# --------------------------------------------------------------------------------------------- replay


class ReplayGuard:
    """Rejects stale timestamps and ``(sender, seq)`` pairs already seen; thread-safe.

    Per sender it keeps the highest ``seq`` seen and a bitmap of the ``window`` numbers below it, so
    messages that overtake each other (several sockets of one process) are still accepted once. A number
    older than the window is refused as a replay. A sender is forgotten once its newest timestamp is more
    than ``max_skew`` seconds old: any replay of its messages is then refused as stale, so memory stays
    bounded by the senders active in the last ``max_skew`` seconds.

    Call :meth:`check` only on authenticated messages (``decode`` does): forged ones must not move state.
    """

    def __init__(self, *, window: int = 4096, max_skew: float = 300.0, clock: Callable[[], float] = time.time):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"ReplayGuard window must be an integer >= 1; got {window!r}")
        if not (isinstance(max_skew, (int, float)) and math.isfinite(max_skew) and max_skew > 0):
            raise ValueError(f"ReplayGuard max_skew must be a positive number of seconds; got {max_skew!r}")
        self.window = window
        self.max_skew = float(max_skew)
        self._clock = clock
        self._lock = threading.Lock()
        self._senders: dict[str, list] = {}  # sender -> [highest seq, bitmap (bit d = highest - d seen), newest ts]
        self._next_prune = 0.0

    def __len__(self) -> int:
        return len(self._senders)

    def check(self, sender: str, seq: int, ts: float) -> None:
        """Accept (and remember) the message, or raise ``BadMessage("stale" | "replay")``."""
        now = self._clock()
        if not abs(now - ts) <= self.max_skew:  # written so that NaN fails too
            raise BadMessage("stale", f"timestamp {ts:.3f} is {now - ts:+.1f}s from this host's clock "
                                      f"(allowed ±{self.max_skew:g}s); check the clocks (NTP) of both hosts")
        with self._lock:
            if now >= self._next_prune:
                self._prune(now)
            state = self._senders.get(sender)
            if state is None:
                self._senders[sender] = [seq, 1, ts]
                return
            highest, seen, newest = state
            if seq > highest:
                shift = seq - highest
                seen = ((seen << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
                state[0], state[1] = seq, seen
            else:
                back = highest - seq
                if back >= self.window:
                    raise BadMessage("replay", f"seq {seq} from {sender} is older than the replay window "
                                               f"({self.window} below {highest})")
                if (seen >> back) & 1:
                    raise BadMessage("replay", f"seq {seq} from {sender} was already received")
                state[1] = seen | (1 << back)
            state[2] = max(newest, ts)

    def _prune(self, now: float) -> None:
        cutoff = now - self.max_skew
        for sender in [s for s, state in self._senders.items() if state[2] < cutoff]:
            del self._senders[sender]
        self._next_prune = now + min(self.max_skew, 60.0) / 4


# --------------------------------------------------------------------------------------------- encode


def check_secret(secret: bytes) -> None:
    """Raise ``ValueError`` unless ``secret`` is non-empty bytes; the message never contains the secret."""
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        got = "empty bytes" if isinstance(secret, (bytes, bytearray)) else type(secret).__name__  # never echo it
        raise ValueError(f"secret must be non-empty bytes (the job's message-signing key, CONVEYOR_JOB_SECRET); "
                         f"got {got}")


class Wire(NamedTuple):
    """A tensor ready to send: a C-contiguous little-endian array and its wire dtype name."""

    array: np.ndarray
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


def as_wire(tensor: Any) -> Wire:
    """A numpy array, ``torch.Tensor`` or :class:`Wire` → :class:`Wire`, copying only when it must.

    ``encode`` does this itself; call it first to check a batch of tensors before sending any of them.
    """
    return tensor if isinstance(tensor, Wire) else Wire(*_wire_array(tensor))


def _wire_array(tensor: Any) -> tuple[np.ndarray, str]:
    """``(contiguous little-endian array, wire dtype name)`` for a numpy array or a ``torch.Tensor``."""
    if isinstance(tensor, Wire):
        return tensor.array, tensor.dtype
    if isinstance(tensor, np.generic):  # a numpy scalar, e.g. what arithmetic on a 0-d array returns
        tensor = np.asarray(tensor)
    if not isinstance(tensor, np.ndarray):
        if type(tensor).__module__.split(".")[0] == "torch":
            return from_torch(tensor)
        raise TypeError(f"tensors must be numpy arrays or torch tensors; got {type(tensor).__name__}")
    name = tensor.dtype.name
    wire = ALLOWED_DTYPES.get(name)
    if wire is None or name == "bfloat16" and tensor.dtype.itemsize != 2:
        raise ValueError(f"dtype {tensor.dtype} cannot be sent; allowed: {', '.join(ALLOWED_DTYPES)}")
    if name == "bfloat16":  # e.g. ml_dtypes.bfloat16: send the bit pattern
        wire = tensor.dtype
    elif tensor.dtype != wire:  # big-endian input: the wire is little-endian
        tensor = tensor.astype(wire)
    if not tensor.flags.c_contiguous:
        tensor = np.ascontiguousarray(tensor)  # (not for every array: it turns a 0-d array into 1-d)
    return tensor, name


def _frame_view(array: np.ndarray) -> memoryview:
    """The array's bytes as a flat ``memoryview`` (no copy; works for 0-d arrays and custom dtypes)."""
    return memoryview(array.reshape(-1).view(np.uint8))


@functools.lru_cache(maxsize=1024)
def _frame_mac(secret: bytes, sender: str) -> AESGCM:
    """The GMAC of one sender: its own AES key, derived from the job's secret and the sender id."""
    return AESGCM(hmac.new(secret, _FRAME_KEY_CONTEXT + sender.encode(), hashlib.sha256).digest())


def _frame_tags(secret: bytes, sender: str, seq: int, frames: Sequence[Any]) -> bytes:
    """One GMAC tag per tensor frame: AES-GCM of nothing, the frame as associated data, nonce (seq, index)."""
    mac = _frame_mac(bytes(secret), sender)
    return b"".join(mac.encrypt(_NONCE.pack(seq, i), b"", frame) for i, frame in enumerate(frames))


def _sign(secret: bytes, frames: Sequence[Any], frame_tags: bytes) -> bytes:
    """HMAC-SHA256 over the header (``frames[0]``), every frame's length and the tensor frames' GMAC tags."""
    mac = hmac.new(secret, digestmod="sha256")
    mac.update(_DOMAIN)
    mac.update(_U64.pack(len(frames)))
    for frame in frames:
        mac.update(_U64.pack(len(frame)))  # every frame here is bytes or a flat byte memoryview
    mac.update(frames[0])
    mac.update(frame_tags)
    return mac.digest()


def _trailer(secret: bytes, frames: Sequence[Any], sender: str, seq: int) -> bytes:
    """The last frame of a message whose header and tensor frames are ``frames``."""
    tags = _frame_tags(secret, sender, seq, frames[1:])
    return tags + _sign(secret, frames, tags)


def encode(kind: str, header: dict[str, Any] | None = None, tensors: Sequence[Any] = (), *, secret: bytes,
           sender: str, seq: int, recipient: str | None = None, reply_to: int | None = None,
           part: tuple[int, int, int] | None = None, ts: float | None = None) -> list[Any]:
    """The frames of one message: ``[header bytes, tensor memoryviews..., tag bytes]``.

    Tensors are numpy arrays (made C-contiguous; a non-contiguous or big-endian array is copied once),
    ``torch.Tensor``s (detached, moved to the CPU if needed) or :class:`Wire` objects. The frames view
    the arrays' memory, so the arrays must not change until the message is on the wire (for a request:
    until its reply arrives).
    ``recipient`` binds the message to one task; ``reply_to`` marks a reply to request ``seq``; ``part``
    is ``(index, count, seq of part 0)`` for one message of a split request or reply.
    """
    check_secret(secret)
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"message kind must be a non-empty string; got {kind!r}")
    if not isinstance(sender, str) or not sender:
        raise ValueError(f"sender must be a non-empty string (see sender_id()); got {sender!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 1 << 63:
        raise ValueError(f"seq must be an integer in [0, 2**63); got {seq!r}")
    header = dict(header or {})
    clash = RESERVED_KEYS.intersection(header)
    if clash:
        raise ValueError(f"header keys {sorted(clash)} are reserved by the message format; rename them")
    arrays = [_wire_array(t) for t in tensors]
    meta: dict[str, Any] = {
        "v": VERSION, "kind": kind, "sender": sender, "seq": seq,
        "ts": float(time.time() if ts is None else ts),
        "tensors": [[name, list(a.shape), a.nbytes] for a, name in arrays],
    }
    if recipient is not None:
        meta["to"] = recipient
    if reply_to is not None:
        meta["re"] = int(reply_to)
    if part is not None:
        index, count, first = (int(x) for x in part)
        if not (0 <= index < count <= MAX_PARTS and (index > 0 or first == seq)):
            raise ValueError(f"part must be (index, count, seq of part 0) with 0 <= index < count; got {part!r}")
        meta["part"] = [index, count, first]
    meta.update(header)
    try:
        head = msgpack.packb(meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"message header for {kind!r} is not msgpack-serialisable ({exc}); use str, bytes, "
                         f"int, float, bool, None, lists and str-keyed dicts") from None
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"message header for {kind!r} is {len(head)} bytes, over the {MAX_HEADER_BYTES} limit; "
                         f"send large data as tensors")
    frames: list[Any] = [head, *(_frame_view(a) for a, _ in arrays)]
    frames.append(_trailer(secret, frames, sender, seq))
    return frames


# --------------------------------------------------------------------------------------------- decode


def _buffer(frame: Any) -> memoryview:
    """A flat byte view of a received frame: ``zmq.Frame``, bytes, bytearray or memoryview."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    view = buf if isinstance(buf, memoryview) else memoryview(frame)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def _require(meta: dict, key: str, types: type | tuple[type, ...]) -> Any:
    value = meta.get(key)
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        value = None  # True is an int in Python, not a seq number on the wire
    if not isinstance(value, types):
        raise BadMessage("header", f"field {key!r} is missing or not {getattr(types, '__name__', types)}")
    return value


def _tensor_specs(meta: dict, views: list[memoryview]) -> list[tuple[str, tuple[int, ...]]]:
    specs = _require(meta, "tensors", list)
    if len(specs) != len(views):
        raise BadMessage("frame_count", f"header lists {len(specs)} tensors but {len(views)} tensor frames came")
    out = []
    for i, spec in enumerate(specs):
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)
                and isinstance(spec[1], list) and type(spec[2]) is int):
            raise BadMessage("header", f"tensor {i} is not [dtype, shape, nbytes]")
        name, shape, nbytes = spec
        if name not in ALLOWED_DTYPES:
            raise BadMessage("dtype", f"tensor {i} has dtype {name[:32]!r}; allowed: {', '.join(ALLOWED_DTYPES)}")
        if len(shape) > MAX_DIMS or not all(type(d) is int and d >= 0 for d in shape):
            raise BadMessage("shape", f"tensor {i} shape is not a list of at most {MAX_DIMS} sizes >= 0")
        expected = math.prod(shape) * ALLOWED_DTYPES[name].itemsize  # Python ints: no overflow
        if expected != nbytes or nbytes != views[i].nbytes:
            raise BadMessage("shape", f"tensor {i}: shape {shape[:MAX_DIMS]} of {name} is {expected} bytes, header "
                                      f"says {nbytes}, frame has {views[i].nbytes}")
        out.append((name, tuple(shape)))
    return out


def decode(frames: Sequence[Any], *, secret: bytes, replay_guard: ReplayGuard | None,
           recipient: str | None = None) -> Message:
    """Check and unpack one message (the frames after any ROUTER identity); raise :class:`BadMessage`.

    ``replay_guard=None`` skips the timestamp and replay checks (for tools and tests only; a server and a
    client always pass one). With ``recipient`` set, the message must have been signed for it.
    """
    check_secret(secret)
    if len(frames) < 2:
        raise BadMessage("frame_count", f"{len(frames)} frame(s); a message has a header, tensors and a tag")
    views = [_buffer(f) for f in frames]
    signed, claimed = _check_signature(secret, views)
    meta = _parse_header(views[0])
    kind = _require(meta, "kind", str)
    sender = _require(meta, "sender", str)
    seq = _require(meta, "seq", int)
    if not 0 <= seq < 1 << 64:
        raise BadMessage("header", "field 'seq' is out of range")
    if not hmac.compare_digest(_frame_tags(secret, sender, seq, signed[1:]), claimed):
        raise BadMessage("signature", "a tensor frame's GMAC does not match: damaged, or forged by someone "
                                      "holding another job's secret")
    ts = float(_require(meta, "ts", (int, float)))
    specs = _tensor_specs(meta, signed[1:])
    to, reply_to, part = _routing(meta, seq)
    if recipient is not None and to != recipient:
        raise BadMessage("recipient", f"message from {sender[:64]} was signed for {str(to)[:64]!r}, not {recipient!r}")
    if replay_guard is not None:
        replay_guard.check(sender, seq, ts)
    tensors = []
    for (name, shape), view in zip(specs, signed[1:], strict=True):
        array = np.frombuffer(view, dtype=ALLOWED_DTYPES[name]).reshape(shape)
        if array.ctypes.data % array.dtype.alignment:
            array = array.copy()  # small frames share ZeroMQ's receive buffer at odd offsets
        tensors.append(array)
    header = {k: v for k, v in meta.items() if k not in RESERVED_KEYS}
    return Message(kind=kind, header=header, tensors=tensors, sender=sender, seq=seq, ts=ts,
                   dtypes=[name for name, _ in specs], recipient=to, reply_to=reply_to, part=part)


def _check_signature(secret: bytes, views: list[memoryview]) -> tuple[list[memoryview], memoryview]:
    """The signed frames and the tensor frames' claimed GMAC tags, once the HMAC over the header, the frame
    lengths and those tags matches (the header size is checked first, before hashing anything)."""
    if views[0].nbytes > MAX_HEADER_BYTES:
        raise BadMessage("header_size", f"header frame is {views[0].nbytes} bytes (limit {MAX_HEADER_BYTES})")
    signed, trailer = views[:-1], views[-1]
    claimed = trailer[: trailer.nbytes - TAG_BYTES]  # the tensor frames' GMAC tags
    if (trailer.nbytes != TAG_BYTES + FRAME_TAG_BYTES * (len(signed) - 1)
            or not hmac.compare_digest(_sign(secret, signed, claimed), trailer[-TAG_BYTES:])):
        raise BadMessage("signature", "HMAC-SHA256 tag does not match: forged, damaged or signed with another "
                                      "job's secret")
    return signed, claimed


def _parse_header(view: memoryview) -> dict[str, Any]:
    """The authenticated header frame as a map of this code's version."""
    try:
        meta = msgpack.unpackb(view, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # any parse failure of signed-but-broken bytes is a drop, never a crash
        raise BadMessage("header", f"header is not msgpack ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise BadMessage("header", f"header is a msgpack {type(meta).__name__}, not a map")
    version = meta.get("v")
    if type(version) is not int or version != VERSION:
        raise BadMessage("version", f"header version {version!r}; this code speaks version {VERSION}")
    return meta


def _routing(meta: dict[str, Any], seq: int) -> tuple[str | None, int | None, tuple[int, int, int] | None]:
    """``(to, re, part)`` of a header, type-checked."""
    to = meta.get("to")
    reply_to = meta.get("re")
    if (to is not None and not isinstance(to, str)) or (reply_to is not None and type(reply_to) is not int):
        raise BadMessage("header", "field 'to' or 're' has the wrong type")
    part = meta.get("part")
    if part is not None:
        if not (isinstance(part, list) and len(part) == 3 and all(type(x) is int for x in part)
                and 0 <= part[0] < part[1] <= MAX_PARTS and (part[0] > 0 or part[2] == seq)):
            raise BadMessage("header", "field 'part' is not [index, count, seq of part 0]")
        part = tuple(part)
    return to, reply_to, part


# --------------------------------------------------------------------------------------------- torch


def from_torch(tensor: Any) -> tuple[np.ndarray, str]:
    """``torch.Tensor`` → ``(numpy array sharing its memory, wire dtype name)``.

    Copies only when it must: a tensor on an accelerator comes to the CPU, a non-contiguous one is made
    contiguous. ``bfloat16`` becomes its ``uint16`` bit pattern with the wire name ``"bfloat16"``.
    """
    import torch  # lazily: the framing and the transport do not need PyTorch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ALLOWED_DTYPES["bfloat16"]), "bfloat16"
    try:
        array = t.numpy()
    except TypeError:
        array = None
    if array is None or array.dtype.name not in ALLOWED_DTYPES:
        raise ValueError(f"torch dtype {t.dtype} cannot be sent; allowed: {', '.join(ALLOWED_DTYPES)}")
    return array, array.dtype.name


def to_torch(array: np.ndarray, dtype: str | None = None) -> Any:
    """numpy array (as decoded) → ``torch.Tensor`` on the same memory; ``dtype="bfloat16"`` views the bits.

    A read-only array (frames received as ``bytes``) is copied, because PyTorch tensors are always
    writable; arrays on received ZeroMQ frames are writable and are not copied.
    """
    import torch  # lazily, see from_torch

    if not array.flags.writeable:
        array = array.copy()
    if dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
