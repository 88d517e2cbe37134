"""Free TCP ports for a job's tasks, found by binding and asking the kernel which port it gave.

The ports are released again before the tasks start, so another program could in principle take one
in between; keeping them reserved would need the task to inherit the bound socket (torchrun's
``master_listen_fd``), which the scripts conveyor starts do not expect. The window is kept short instead:
the launcher asks for its ports just before it starts the tasks, all in one call, so that the kernel hands
out distinct ports (each socket stays bound until every port is known).

``CONVEYOR_PORT_RANGE=LOW-HIGH`` in the environment takes the ports from that range instead of the kernel's
ephemeral range, each one still bound to prove it free, walking on from the last port this process handed
out: the parallel test suite gives each worker its own range below the ephemeral one (tests/conftest.py),
so that neither another worker's launcher nor an outgoing connection's source port can take a port in the
window between its release and the task's listen.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

from conveyor.cluster.variables import PORT_RANGE_VAR
from conveyor.errors import AddressInUseError

__all__ = ["PORT_RANGE_VAR", "free_ports"]

_last: dict[tuple[int, int], int] = {}  # per range: the last port handed out by this process


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that nothing listens on at ``host`` right now.

    ``host`` is the address the tasks will listen on (a name or an IPv4/IPv6 literal). When it is not an
    address of this machine (a name that resolves elsewhere, a NAT address) the ports are taken from the
    wildcard address of the same family instead, which is what a task binding ``0.0.0.0`` would see.
    With ``CONVEYOR_PORT_RANGE`` set they come from that range (see the module docstring).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count = {count!r}; expected a number of ports >= 0")
    family, address = _bind_address(host)
    span = _port_range(os.environ.get(PORT_RANGE_VAR))
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            try:
                sock.bind((address, 0))
            except OSError:  # not an address of this machine: any interface of the family
                address = "::" if family == socket.AF_INET6 else "0.0.0.0"
                sock.bind((address, 0))
            if span is not None:  # port 0 only proved the address; the range's port goes on a new socket
                sock.close()
                sockets[-1] = _bind_in_range(family, address, span)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _port_range(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    low, sep, high = text.partition("-")
    if sep and low.strip().isdigit() and high.strip().isdigit() and 1 <= int(low) <= int(high) <= 65535:
        return int(low), int(high)
    raise ValueError(f"{PORT_RANGE_VAR}={text!r} is not a port range; expected LOW-HIGH with 1 <= LOW <= HIGH "
                     f"<= 65535 (e.g. 20000-29999), or unset it to take the kernel's free ports")


def _bind_in_range(family: socket.AddressFamily, address: str, span: tuple[int, int]) -> socket.socket:
    """A socket bound to the first free port of ``span`` after the last one handed out (a random start)."""
    low, high = span
    start = _last.get(span, random.randint(low, high)) + 1
    start = low if start > high else start
    for port in itertools.chain(range(start, high + 1), range(low, start)):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((address, port))
        except OSError:  # in use, or held in TIME_WAIT: a task binding it would fail the same way
            sock.close()
            continue
        _last[span] = port
        return sock
    raise AddressInUseError(f"no free port on {address} in {PORT_RANGE_VAR}={low}-{high}: every one is in use; "
                            f"widen the range or unset {PORT_RANGE_VAR}")


def _bind_address(host: str) -> tuple[socket.AddressFamily, str]:
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve host {host!r} to pick free ports on it: {e.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr[0]
