"""Bounded memory, measured as RSS: a worker far faster than its trainer grows neither the trainer's nor the
dispatcher's peak RSS (VmHWM, reset with ``clear_refs`` at the start) past what the queue sizes allow."""

from __future__ import annotations

import time

import pytest
from svc_pipelines import BIG_ELEMENT_BYTES

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

MIB = 1 << 20
OPTIONS = {"max_outstanding": 1, "per_request": 2, "buffer": 2}


def vm_kib(pid: int | str, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak(pid: int | str) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS of {pid} ({e})")


def test_slow_consumer_keeps_trainer_and_dispatcher_rss_within_the_queue_bound(roles, monkeypatch):
    """The trainer holds at most its queue and the requests in flight (buffer + max_outstanding x per_request
    elements), each at most 3 times (frame, decoded array, the one in use), plus 64 MiB for the transport and
    the interpreter; the dispatcher never holds an element (32 MiB). Unbounded, the worker would make about a
    GiB per second of 4 MiB elements while the trainer takes 5 elements per second."""
    import svc_pipelines

    roles.serve()
    dispatcher = roles.procs[0][0]
    reset_peak(dispatcher.pid)
    dispatcher_base = vm_kib(dispatcher.pid, "VmRSS")
    roles.worker("svc_pipelines:endless_big", "--buffer", "2")
    it = iter(svc_pipelines.endless_big().distribute(roles.service, **OPTIONS))
    first = next(it)  # imports, connections and the job exist now: what follows is the elements only
    reset_peak("self")
    base = vm_kib("self", "VmRSS")
    taken = [first]
    for _ in range(12):
        time.sleep(0.2)
        taken.append(next(it))
    trainer_growth = vm_kib("self", "VmHWM") - base
    dispatcher_growth = vm_kib(dispatcher.pid, "VmHWM") - dispatcher_base
    it.close()
    held = OPTIONS["buffer"] + OPTIONS["max_outstanding"] * OPTIONS["per_request"]
    assert [int(e[0]) for e in taken] == list(range(13))  # the elements are real, in order, 4 MiB each
    assert taken[0].nbytes == BIG_ELEMENT_BYTES
    assert trainer_growth * 1024 <= 3 * held * BIG_ELEMENT_BYTES + 64 * MIB, trainer_growth
    assert dispatcher_growth * 1024 <= 32 * MIB, dispatcher_growth
