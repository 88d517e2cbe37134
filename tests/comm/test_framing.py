"""Message framing: round trips of every dtype, zero copies, and every reason a message is dropped."""

from __future__ import annotations

import os
import time

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conveyor.comm.framing import (
    ALLOWED_DTYPES,
    MAX_HEADER_BYTES,
    VERSION,
    BadMessage,
    ReplayGuard,
    Wire,
    as_wire,
    decode,
    encode,
    from_torch,
    next_seq,
    sender_id,
    sender_role,
    to_torch,
)
from conveyor.comm.framing import _trailer as trailer  # to build messages that are signed but malformed

KEY = b"k" * 32
NUMPY_DTYPES = [name for name in ALLOWED_DTYPES if name != "bfloat16"]


def frames_of(*tensors, header=None, kind="push", seq=None, **kw):
    return encode(kind, header or {}, tensors, secret=KEY, sender="worker:0#abc", seq=seq or next_seq(), **kw)


def received(frames):
    """What the transport hands to decode: each frame in its own writable buffer, as ZeroMQ delivers them."""
    return [bytearray(bytes(f)) for f in frames]


def signed(meta: dict, tensor_frames=()) -> list:
    """A message whose header is ``meta`` verbatim, correctly signed: it reaches the checks after the tag."""
    head = msgpack.packb(meta) if not isinstance(meta, bytes) else meta
    frames = [head, *tensor_frames]
    sender, seq = (meta.get("sender"), meta.get("seq")) if isinstance(meta, dict) else (None, None)
    if not isinstance(sender, str) or type(seq) is not int:
        sender, seq = "w#1", 0  # the header does not say: these tags cannot match, but the header fails first
    return [*frames, trailer(KEY, [memoryview(f) for f in frames], sender, seq)]


def base_meta(**extra):
    meta = {"v": VERSION, "kind": "push", "sender": "w#1", "seq": next_seq(), "ts": time.time(), "tensors": []}
    meta.update(extra)
    return meta


def reason(frames, **kw) -> str:
    kw.setdefault("secret", KEY)
    kw.setdefault("replay_guard", ReplayGuard())
    with pytest.raises(BadMessage) as info:
        decode(frames, **kw)
    return info.value.reason


# ----------------------------------------------------------------------------------------- round trips


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_round_trip_of_every_numpy_dtype(data):
    dtype = data.draw(st.sampled_from(NUMPY_DTYPES))
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    array = data.draw(hnp.arrays(np.dtype(ALLOWED_DTYPES[dtype]), shape))
    header = {"step": data.draw(st.integers(-(2**63), 2**63 - 1)), "name": data.draw(st.text(max_size=20))}
    seq = next_seq()
    message = decode(received(frames_of(array, array.T, header=header, seq=seq)), secret=KEY,
                     replay_guard=ReplayGuard())
    assert (message.kind, message.header, message.sender, message.seq) == ("push", header, "worker:0#abc", seq)
    assert message.dtypes == [dtype, dtype]
    for got, want in zip(message.tensors, [array, array.T], strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)  # NaNs compare equal here


def test_torch_tensors_round_trip_including_bfloat16():
    torch = pytest.importorskip("torch")
    tensors = [torch.randn(3, 5).to(dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)]
    tensors += [torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.tensor([True, False]),
                torch.randn(4, 4, requires_grad=True).t()]  # autograd and non-contiguous
    message = decode(received(frames_of(*tensors)), secret=KEY, replay_guard=None)
    assert message.dtypes[2] == "bfloat16" and message.tensors[2].dtype == np.uint16
    for got, want in zip(message.torch_tensors(), tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want.detach())


def test_torch_helpers_share_memory():
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(4, dtype=torch.bfloat16)
    array, name = from_torch(tensor)
    assert name == "bfloat16" and array.ctypes.data == tensor.data_ptr()
    back = to_torch(array, "bfloat16")
    back += 1
    assert tensor.tolist() == [1.0] * 4
    readonly = np.frombuffer(b"\x00" * 8, dtype=np.float32)  # frames received as bytes are read-only
    assert to_torch(readonly).tolist() == [0.0, 0.0]


def test_encode_does_not_copy_tensors_and_decode_views_the_frames():
    array = np.arange(1000, dtype=np.float32)
    frames = frames_of(array)
    assert isinstance(frames[1], memoryview) and np.shares_memory(np.asarray(frames[1]), array)
    buffers = received(frames)
    message = decode(buffers, secret=KEY, replay_guard=None)
    buffers[1][:4] = np.float32(42).tobytes()
    assert message.tensors[0][0] == 42  # the array is a view on the received frame


def test_unaligned_small_frames_are_copied_to_aligned_arrays():
    frames = received(frames_of(np.arange(3, dtype=np.float64)))
    odd = memoryview(bytearray(len(frames[1]) + 1))[1:]  # ZeroMQ packs small frames at odd offsets
    odd[:] = frames[1]
    message = decode([frames[0], odd, frames[2]], secret=KEY, replay_guard=None)
    assert message.tensors[0].flags.aligned and message.tensors[0].tolist() == [0.0, 1.0, 2.0]


def test_big_endian_and_non_contiguous_inputs_are_sent_little_endian():
    array = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
    message = decode(received(frames_of(array)), secret=KEY, replay_guard=None)
    assert message.tensors[0].dtype == np.dtype("<i4")
    np.testing.assert_array_equal(message.tensors[0], array)


def test_wire_tensors_and_parts_and_addressing():
    with pytest.raises(ValueError, match="allowed"):
        as_wire(np.ones(3, dtype=np.uint16))  # not an allowed dtype by itself ...
    bits = Wire(np.ones(3, dtype="<u2"), "bfloat16")  # ... but a bfloat16 bit pattern is
    assert as_wire(bits) is bits
    seq = next_seq()
    message = decode(received(frames_of(bits, seq=seq, recipient="ps:0", reply_to=7, part=(0, 2, seq))), secret=KEY,
                     replay_guard=None, recipient="ps:0")
    assert (message.dtypes, message.recipient, message.reply_to, message.part) == (["bfloat16"], "ps:0", 7, (0, 2, seq))


def test_encode_rejects_what_cannot_be_sent():
    with pytest.raises(ValueError, match="reserved"):
        frames_of(header={"seq": 1})
    with pytest.raises(ValueError, match="msgpack"):
        frames_of(header={"x": object()})
    with pytest.raises(ValueError, match="allowed"):
        frames_of(np.ones(2, dtype=np.complex64))
    with pytest.raises(ValueError, match="allowed"):
        frames_of(np.ones(2, dtype=np.uint16))
    with pytest.raises(TypeError):
        frames_of([1.0, 2.0])
    with pytest.raises(ValueError, match="secret"):
        encode("push", secret=b"", sender="w#1", seq=1)
    with pytest.raises(ValueError, match="limit"):
        frames_of(header={"blob": b"x" * MAX_HEADER_BYTES})
    with pytest.raises(ValueError, match="part"):
        frames_of(seq=5, part=(0, 2, 4))  # part 0 must carry its own seq


# ----------------------------------------------------------------------------------------- bad messages


def test_a_flipped_byte_in_any_frame_breaks_the_signature():
    frames = frames_of(np.arange(10, dtype=np.float32), np.ones((2, 2), dtype=np.int8), header={"a": 1})
    for i in range(len(frames)):
        for position in (0, len(frames[i]) // 2, len(frames[i]) - 1):
            tampered = received(frames)
            tampered[i][position] ^= 0x01
            assert reason(tampered) == "signature", (i, position)


def test_tensor_frames_cannot_be_swapped_or_replayed_under_another_seq():
    a, b = np.arange(4, dtype=np.float32), np.arange(4, 8, dtype=np.float32)
    frames = received(frames_of(a, b))
    assert reason([frames[0], frames[2], frames[1], frames[3]]) == "signature"  # same lengths, other order
    other = received(frames_of(a, b))  # another message: its own seq, so its own GMAC nonces
    decoded = decode([other[0], frames[1], frames[2], other[3]], secret=KEY, replay_guard=None)
    assert np.array_equal(decoded.tensors[1], b)  # the same bytes with that message's own tags: fine
    assert reason([other[0], frames[1], frames[2], frames[3]]) == "signature"  # tags of another message


def test_truncated_missing_and_extra_frames_are_rejected():
    frames = received(frames_of(np.arange(10, dtype=np.float32)))
    assert reason([frames[0], frames[1][:-1], frames[2]]) == "signature"  # truncated tensor
    assert reason([frames[0], frames[1], frames[2][:-1]]) == "signature"  # truncated tag
    assert reason([frames[0], frames[2]]) == "signature"  # a tensor frame missing
    assert reason([*frames, b"extra"]) == "signature"  # appended after the tag
    assert reason([frames[0], frames[1], b"extra", frames[2]]) == "signature"  # inserted
    assert reason([frames[1][:2] + frames[1][2:], frames[0], frames[2]]) == "signature"  # reordered
    assert reason([frames[0]]) == "frame_count"
    assert reason([]) == "frame_count"


def test_wrong_secret_is_rejected():
    frames = received(frames_of(np.ones(3)))
    assert reason(frames, secret=b"another job's secret") == "signature"


def test_oversized_header_is_rejected_before_hashing():
    assert reason([b"\x00" * (MAX_HEADER_BYTES + 1), b"t" * 32]) == "header_size"


def test_replayed_and_stale_messages_are_rejected():
    guard = ReplayGuard(window=8, max_skew=60)
    first = received(frames_of(np.ones(2), seq=1000))
    decode(first, secret=KEY, replay_guard=guard)
    assert reason(first, replay_guard=guard) == "replay"  # the very same message again
    decode(received(frames_of(seq=1005)), secret=KEY, replay_guard=guard)
    decode(received(frames_of(seq=1003)), secret=KEY, replay_guard=guard)  # overtaken, inside the window: fine
    assert reason(received(frames_of(seq=1003)), replay_guard=guard) == "replay"
    decode(received(frames_of(seq=1020)), secret=KEY, replay_guard=guard)
    assert reason(received(frames_of(seq=1010)), replay_guard=guard) == "replay"  # older than the window
    assert reason(received(frames_of(seq=2000, ts=time.time() - 61)), replay_guard=guard) == "stale"
    assert reason(received(frames_of(seq=2001, ts=time.time() + 61)), replay_guard=guard) == "stale"
    assert reason(received(frames_of(seq=2002, ts=float("nan"))), replay_guard=guard) == "stale"


def test_forged_messages_do_not_move_the_replay_window():
    guard = ReplayGuard()
    forged = received(encode("push", secret=b"forger", sender="worker:0#abc", seq=10**9))
    assert reason(forged, replay_guard=guard) == "signature"
    assert len(guard) == 0
    decode(received(frames_of(seq=5)), secret=KEY, replay_guard=guard)  # a real, lower seq still goes through


def test_replay_guard_forgets_senders_only_once_their_messages_are_stale():
    now = [1000.0]
    guard = ReplayGuard(max_skew=10, clock=lambda: now[0])
    guard.check("a#1", 1, 1000.0)
    guard.check("b#1", 1, 1000.0)
    now[0] = 1005.0
    guard.check("b#1", 2, 1005.0)
    now[0] = 1012.0
    guard.check("c#1", 1, 1012.0)  # prunes a#1 (newest 1000 < 1002), keeps b#1 (1005)
    assert len(guard) == 2
    with pytest.raises(BadMessage) as info:
        guard.check("a#1", 1, 1000.0)  # the forgotten sender's old message is refused as stale
    assert info.value.reason == "stale"
    with pytest.raises(ValueError):
        ReplayGuard(window=0)
    with pytest.raises(ValueError):
        ReplayGuard(max_skew=float("inf"))


@pytest.mark.parametrize(
    ("form", "meta", "tensor_frames", "expected"),
    [
        ("raw", b"\xc1\xc1not msgpack", (), "header"),
        ("obj", [1, 2, 3], (), "header"),
        ("obj", {"v": VERSION}, (), "header"),
        ("base", {}, (), None),  # the control: the base header is fine
        ("base", {"v": VERSION + 1}, (), "version"),
        ("base", {"v": VERSION - 1}, (), "version"),
        ("base", {"v": True}, (), "version"),
        ("base", {"kind": 7}, (), "header"),
        ("base", {"seq": True}, (), "header"),
        ("base", {"tensors": [["float32", [2], 8]]}, (), "frame_count"),
        ("base", {"tensors": [["complex64", [1], 8]]}, (b"\x00" * 8,), "dtype"),
        ("base", {"tensors": [["object", [1], 8]]}, (b"\x00" * 8,), "dtype"),
        ("base", {"tensors": [["float32", [2, 3], 8]]}, (b"\x00" * 8,), "shape"),
        ("base", {"tensors": [["float32", [2**40, 2**40], 2**63 - 1]]}, (b"\x00" * 8,), "shape"),  # huge shape
        ("base", {"tensors": [["float32", [-2], 8]]}, (b"\x00" * 8,), "shape"),
        ("base", {"tensors": [["float32", [1] * 40, 4]]}, (b"\x00" * 4,), "shape"),
        ("base", {"tensors": [["float32", [2]]]}, (b"\x00" * 8,), "header"),
        ("base", {"part": [1, 1, 0]}, (), "header"),
        ("base", {"to": 5}, (), "header"),
    ],
)
def test_signed_but_malformed_headers_are_rejected(form, meta, tensor_frames, expected):
    header = {"raw": lambda: meta, "obj": lambda: msgpack.packb(meta), "base": lambda: base_meta(**meta)}[form]()
    frames = signed(header, tensor_frames)
    if expected is None:
        assert decode(frames, secret=KEY, replay_guard=ReplayGuard()).kind == "push"
    else:
        assert reason(frames) == expected


def test_messages_for_another_task_are_rejected():
    frames = received(frames_of(recipient="ps:0"))
    assert reason(frames, recipient="ps:1") == "recipient"
    assert reason(received(frames_of()), recipient="ps:1") == "recipient"  # no recipient at all
    assert decode(frames, secret=KEY, replay_guard=None, recipient="ps:0").recipient == "ps:0"


def test_random_bytes_never_raise_anything_but_bad_message():
    rng = np.random.default_rng(0)
    for _ in range(200):
        frames = [rng.bytes(int(rng.integers(0, 200))) for _ in range(int(rng.integers(0, 5)))]
        with pytest.raises(BadMessage):
            decode(frames, secret=KEY, replay_guard=ReplayGuard())


# ----------------------------------------------------------------------------------------- senders


def test_sender_ids_carry_a_per_process_nonce_that_changes_after_fork():
    mine = sender_id("worker:0")
    assert sender_role(mine) == "worker:0" and mine == sender_id("worker:0") and len(mine.split("#")[1]) == 16
    assert next_seq() < next_seq()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports its sender id and next seq
        os.write(write, f"{sender_id('worker:0')} {next_seq()}".encode())
        os._exit(0)
    os.close(write)
    child_id, child_seq = os.read(read, 200).decode().split()
    os.waitpid(pid, 0)
    os.close(read)
    assert child_id != mine and sender_role(child_id) == "worker:0" and int(child_seq) == 1
    with pytest.raises(ValueError):
        sender_id("a#b")
