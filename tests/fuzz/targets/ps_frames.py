"""Fuzz target: what a ps server does to each incoming message (transport ``_Inbox``: ``framing.decode``
under a fixed test secret, then split-message assembly); oracle: ``BadMessage``, or accepted only if
authentic, i.e. byte for byte one of the messages signed here with the secret (the fuzzer cannot forge a
MAC, so anything else accepted is a finding).

An input is a sequence of messages fed to one server inbox in order: each message is a frame count
(1 byte) and that many frames, each a 2-byte little-endian length and its bytes (a short last frame
takes what is left). Several messages per input let the fuzzer reach assembly and the replay window.
"""

from __future__ import annotations

import struct

import numpy as np

from conveyor.comm.framing import BadMessage, ReplayGuard, encode
from conveyor.comm.transport import _Assembly, _Inbox

EXPECTED = (BadMessage,)

SECRET = b"fuzz-ps-frames-test-secret"
TS = 1_700_000_000.0  # every message's timestamp and the guard's clock: no dependence on the real time
SENDER = "worker:0#0123456789abcdef"
_LEN = struct.Struct("<H")


def _signed(seq: int, kind: str, header: dict | None, tensors: list, part=None) -> list[bytes]:
    frames = encode(kind, header, tensors, secret=SECRET, sender=SENDER, seq=seq, recipient="ps:0", part=part,
                    ts=TS)
    return [bytes(f) for f in frames]


_MESSAGES = [
    _signed(1, "push", {"rank": 0, "step": 3, "read": 2, "keys": ["w[0:4]", "b[0:2]"]},
            [np.arange(4, dtype=np.float32), np.ones(2, dtype=np.float64)]),
    _signed(2, "ping", None, []),
    _signed(3, "init", {"fingerprint": "f", "rank": 0}, [np.zeros((2, 3), dtype=np.int8), np.array(7, np.int64)]),
    _signed(4, "push", {"rank": 1}, [np.ones(3, dtype=np.float16)], part=(0, 2, 4)),
    _signed(5, "push", None, [np.ones(5, dtype=np.bool_)], part=(1, 2, 4)),
]
AUTHENTIC = {tuple(m) for m in _MESSAGES}


def _pack(*messages: list[bytes]) -> bytes:
    out = b""
    for frames in messages:
        out += bytes([len(frames)]) + b"".join(_LEN.pack(len(f)) + f for f in frames)
    return out


SEEDS = [_pack(_MESSAGES[0]), _pack(_MESSAGES[1], _MESSAGES[0]), _pack(_MESSAGES[2]),
         _pack(_MESSAGES[3], _MESSAGES[4]), _pack(_MESSAGES[4], _MESSAGES[3], _MESSAGES[3])]


def _split(data: bytes) -> list[list[bytes]]:
    messages, at = [], 0
    while at < len(data):
        count, at = data[at], at + 1
        frames = []
        for _ in range(count):
            (size,) = _LEN.unpack_from(data.ljust(at + 2, b"\x00"), at)
            frames.append(data[at + 2:at + 2 + size])
            at += 2 + size
        messages.append(frames)
    return messages


def target(data: bytes) -> None:
    inbox = _Inbox(SECRET, "ps:0", ReplayGuard(clock=lambda: TS), _Assembly())
    errors = []
    for frames in _split(data):
        try:
            inbox.accept(frames)
        except BadMessage as bad:
            if bad.reason != "part":  # "part" comes after decode accepted the message: check it below
                errors.append(bad)
                continue
        if tuple(frames) not in AUTHENTIC:
            raise AssertionError(f"accepted a message that was not signed with the secret: {frames!r}"[:2000])
    if errors:
        raise errors[0]
