"""A ps task against peers that never authenticate, and without workers: bounded memory, bounded life.

The memory test floods a ps task (a child process, so its RSS is its own) from raw TCP sockets that
speak ZeroMQ's ZMTP 3.0 greeting for the PLAIN mechanism the server uses, then send one command frame
whose header claims ``CLAIM`` bytes, and the zeros after it. Without a frame limit libzmq allocates
the claimed size and fills it as the zeros arrive, before any authentication.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conveyor.cluster import local_cluster, task_environment
from conveyor.comm import transport
from conveyor.comm.transport import Client
from conveyor.launch.ports import free_ports
from conveyor.strategies.ps.client import PSClient
from conveyor.strategies.ps.server import IdleTimeout, ParameterServer, max_frame_bytes

SECRET = b"ps-hardening-secret"
CLAIM = 256 << 20  # per connection: large enough to see, small enough to reproduce safely before the fix
BOUND = 64 << 20  # what the flood may add to the ps task's RSS (its frame limit is 8 MiB per connection)
_FOREIGN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG",
            "OMP_NUM_THREADS")

# ZMTP 3.0 greeting (RFC 23): signature, version 3.0, mechanism "PLAIN" padded to 20 bytes, as-server 0, filler.
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"PLAIN".ljust(20, b"\x00") + b"\x00" + bytes(31)
_LONG_COMMAND = 0x06  # flags: command frame with an 8-byte size


def _clean_env() -> dict[str, str]:
    from taskrun import launcher_var  # keeps the quick exit and the port range (tests/taskrun.py)

    return {k: v for k, v in os.environ.items() if k not in _FOREIGN and not launcher_var(k)}


_VICTIM = """
import sys
from conveyor.strategies.ps.server import ParameterServer
server = ParameterServer(sys.argv[1], b"ps-hardening-secret", index=0, num_workers=1, mode="sync")
print("ready", flush=True)
server.serve(timeout=float(sys.argv[2]))
"""


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """The child's next stdout line, or a failure after ``timeout`` seconds (the child is then killed)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        pytest.fail(f"the child printed nothing within {timeout:g} s")
    return proc.stdout.readline().decode()


def flood(port: int, claim: int, connections: int, sample) -> bool:
    """Open ``connections`` raw ZMTP connections, each claiming a ``claim``-byte command frame, send the
    zeros (all but the last byte, so libzmq is left holding an incomplete frame), calling ``sample()``
    after every MiB. True when the server closed every connection before the frame was complete."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(connections)]
    closed = [False] * connections
    zeros = bytes(1 << 20)
    try:
        for s in socks:
            s.sendall(GREETING + bytes([_LONG_COMMAND]) + struct.pack(">Q", claim))
        for i, s in enumerate(socks):
            sent = 0
            while sent < claim - 1:
                try:
                    sent += s.send(zeros[: min(len(zeros), claim - 1 - sent)])
                except (BrokenPipeError, ConnectionResetError):
                    closed[i] = True
                    break
                sample()
        for i, s in enumerate(socks):  # a server that closed at once left EOF (or a reset) to read
            if not closed[i]:
                closed[i] = _closed_by_peer(s, timeout=5.0)
            sample()
    finally:
        for s in socks:
            s.close()
    return all(closed)


def _count_closed(socks: list[socket.socket], at_least: int, timeout: float) -> int:
    """How many of ``socks`` the server closed, waiting until ``at_least`` are or ``timeout`` seconds pass."""
    deadline, open_, closed = time.monotonic() + timeout, list(socks), 0
    while closed < at_least and (remaining := deadline - time.monotonic()) > 0:
        for s in select.select(open_, [], [], remaining)[0]:
            try:
                data = s.recv(1 << 16)  # the server's greeting comes first, then EOF
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            if not data:
                open_.remove(s)
                closed += 1
    return closed


def _closed_by_peer(s: socket.socket, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        s.settimeout(remaining)
        try:
            if not s.recv(1 << 16):  # the server's greeting comes first, then EOF
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_unauthenticated_frames_claiming_huge_sizes_do_not_grow_the_ps_memory() -> None:
    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-c", _VICTIM, f"127.0.0.1:{port}", "100"], env=_clean_env(),
                            stdout=subprocess.PIPE)
    try:
        assert _readline(proc, 60) == "ready\n"
        victim = psutil.Process(proc.pid)
        before = victim.memory_info().rss
        peak = [before]

        def sample() -> None:
            peak[0] = max(peak[0], victim.memory_info().rss)

        closed = flood(port, CLAIM, 2, sample)
        grew = peak[0] - before
        assert grew < BOUND, f"ps RSS grew by {grew / 2**20:.0f} MiB under 2 x {CLAIM >> 20} MiB claims"
        assert closed, "the ps kept the connections that claimed oversized frames"
        assert proc.poll() is None  # still serving
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


@pytest.mark.timeout(60)
def test_a_connection_that_does_not_finish_the_handshake_is_dropped() -> None:
    port = free_ports(1)[0]
    server = ParameterServer(f"127.0.0.1:{port}", SECRET, index=0, num_workers=1, mode="sync",
                             handshake_timeout=0.5).start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(GREETING)  # and then nothing: no HELLO
            assert _closed_by_peer(s, timeout=20.0), "the ps kept a connection that never authenticated"
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_connections_beyond_the_bound_on_unauthenticated_memory_are_closed() -> None:
    port = free_ports(1)[0]
    server = ParameterServer(f"127.0.0.1:{port}", SECRET, index=0, num_workers=1, mode="sync",
                             handshake_timeout=60.0).start()  # the handshake timeout cannot be what closes them
    frame = max_frame_bytes()
    limit = transport._handshake_limit(frame) if hasattr(transport, "_handshake_limit") else 64  # 64: main's code
    assert limit * (frame + (8 << 10)) <= getattr(transport, "MAX_UNAUTHENTICATED_BYTES", 1 << 30)
    peers = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(limit + 6)]
    try:
        closed = _count_closed(peers, at_least=6, timeout=30.0)
        assert closed >= 6, f"{closed} of {len(peers)} silent connections were closed (bound {limit})"
        assert server.server.stats["dropped_by_reason"].get("unauthenticated", 0) >= 6
        for s in peers:  # the flood ends: honest peers connect again
            s.close()
        with Client(f"127.0.0.1:{port}", SECRET, name="ps:0", timeout=30.0, sender="worker:0") as worker:
            assert worker.request("ping").kind == "ok"
    finally:
        for s in peers:
            s.close()
        server.close()


# -- a ps task without worker traffic ---------------------------------------------------------------------------------


def _ps_task(timeout: float, out: Path) -> tuple[subprocess.Popen, str]:
    """Start ps:0 of a 1-worker job the way `conveyor run` would; returns the process and its address."""
    ports = free_ports(3)
    spec = local_cluster(num_workers=1, num_ps=1, ports=ports[:2])
    task = next(t for t in spec.tasks if t.type == "ps")
    env = _clean_env() | task_environment(spec, task, secret=SECRET, data_dir=out / "data",
                                          output_dir=out / "output", strategy="ps-sync",
                                          master_addr="127.0.0.1", master_port=ports[2])
    env["CONVEYOR_TIMEOUT"] = str(timeout)
    proc = subprocess.Popen([sys.executable, "-c", "import conveyor; conveyor.init()"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, spec.task_address("ps", 0)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_ps_whose_workers_are_gone_exits_after_the_job_timeout(tmp_path: Path) -> None:
    proc, address = _ps_task(3.0, tmp_path)
    try:
        assert "serving ps-sync" in _readline(proc, 60)
        with Client(address, SECRET, name="ps:0", timeout=30.0, sender="worker:0") as worker:
            assert worker.request("stats").kind == "stats"  # heard from worker:0 once, then never again
        left = time.monotonic()
        try:
            output = proc.communicate(timeout=60)[0].decode()
        except subprocess.TimeoutExpired:
            pytest.fail("the ps task kept running 60 s after its only worker left (job timeout 3 s)")
        assert time.monotonic() - left >= 3.0 - 0.5
        assert proc.returncode != 0, output
        assert "worker:0" in output and "3 s" in output and "CONVEYOR_TIMEOUT" in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.timeout(60)
def test_a_silent_but_alive_worker_keeps_its_ps_serving() -> None:
    port = free_ports(1)[0]
    server = ParameterServer(f"127.0.0.1:{port}", SECRET, index=0, num_workers=1, mode="sync")
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(_serve(server, idle_timeout=1.0)))
    thread.start()
    client = PSClient([f"127.0.0.1:{port}"], SECRET, rank=0, num_workers=1, sender="worker:0", timeout=1.0)
    try:
        thread.join(4.0)  # 4 x the timeout without one training request: only the heartbeat talks
        assert thread.is_alive(), f"the ps stopped while its worker was alive: {outcome}"
    finally:
        client.close(done=True)
        thread.join(30.0)
        server.close()
    assert outcome == [True]  # stopped by the worker's "done", not by the idle limit


def _serve(server: ParameterServer, idle_timeout: float) -> object:
    try:
        return server.serve(idle_timeout=idle_timeout)
    except IdleTimeout as exc:
        return exc
