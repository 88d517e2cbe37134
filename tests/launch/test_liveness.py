"""The lifelines of an elastic job (launch/liveness.py): node 0 learns at once that a member's launcher died.

Real sockets on 127.0.0.1: a member introduced with the job secret whose connection closes is gone; one that says
bye first is not; an unsigned introduction, another job's, or a second one for the same member counts for nothing.
"""

from __future__ import annotations

import socket
import time

from conveyor.launch.liveness import Lifelines, farewell, lifeline

SECRET = bytes(range(32))


def _poll_until(lines: Lifelines, want, seconds: float = 5.0) -> set[int]:
    gone: set[int] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gone |= lines.poll()
        if want(gone):
            return gone
        time.sleep(0.02)
    return gone


def test_a_member_whose_connection_closes_is_gone_and_one_that_says_bye_is_not():
    lines = Lifelines("127.0.0.1", secret=SECRET, run="run1")
    try:
        dying = lifeline("127.0.0.1", lines.port, secret=SECRET, run="run1", member=3, timeout=5)
        leaving = lifeline("127.0.0.1", lines.port, secret=SECRET, run="run1", member=4, timeout=5)
        assert dying is not None and leaving is not None
        _poll_until(lines, lambda _: len(lines._members) == 2)
        assert lines.poll() == set()  # open and quiet: nothing to say
        farewell(leaving)
        dying.close()  # as its kernel does when the launcher is killed
        assert _poll_until(lines, lambda gone: 3 in gone) == {3}
        assert lines.poll() == set() and not lines._members
    finally:
        lines.close()


def test_an_introduction_without_the_secret_of_another_job_or_replayed_counts_for_nothing():
    lines = Lifelines("127.0.0.1", secret=SECRET, run="run1")
    try:
        real = lifeline("127.0.0.1", lines.port, secret=SECRET, run="run1", member=2, timeout=5)
        _poll_until(lines, lambda _: len(lines._members) == 1)
        forged = [lifeline("127.0.0.1", lines.port, secret=b"x" * 32, run="run1", member=5, timeout=5),
                  lifeline("127.0.0.1", lines.port, secret=SECRET, run="run2", member=6, timeout=5),
                  lifeline("127.0.0.1", lines.port, secret=SECRET, run="run1", member=2, timeout=5)]  # a replay
        raw = socket.create_connection(("127.0.0.1", lines.port))
        raw.sendall(b"7 " + b"0" * 64 + b"\n")
        forged.append(raw)
        _poll_until(lines, lambda _: not lines._new, seconds=2.0)
        for conn in forged:
            conn.close()
        assert _poll_until(lines, lambda gone: bool(gone), seconds=1.0) == set()  # none of them was a member
        real.close()
        assert _poll_until(lines, lambda gone: 2 in gone) == {2}  # the member introduced first still is
    finally:
        lines.close()


def test_node_0_unreachable_leaves_the_heartbeat_alone():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
    assert lifeline("127.0.0.1", port, secret=SECRET, run="run1", member=1, timeout=1) is None
