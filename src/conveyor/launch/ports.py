"""Free TCP ports for a job's tasks, found by binding port 0 and asking the kernel which port it gave.

The ports are released again before the tasks start, so another program could in principle take one
in between; keeping them reserved would need the task to inherit the bound socket (torchrun's
``master_listen_fd``), which the scripts conveyor starts do not expect. The window is kept short instead:
the launcher asks for its ports just before it starts the tasks, all in one call, so that the kernel hands
out distinct ports (each socket stays bound until every port is known).
"""

from __future__ import annotations

import socket

__all__ = ["free_ports"]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that nothing listens on at ``host`` right now.

    ``host`` is the address the tasks will listen on (a name or an IPv4/IPv6 literal). When it is not an
    address of this machine (a name that resolves elsewhere, a NAT address) the ports are taken from the
    wildcard address of the same family instead, which is what a task binding ``0.0.0.0`` would see.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count = {count!r}; expected a number of ports >= 0")
    family, address = _bind_address(host)
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            try:
                sock.bind((address, 0))
            except OSError:  # not an address of this machine: any interface of the family
                sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _bind_address(host: str) -> tuple[socket.AddressFamily, str]:
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve host {host!r} to pick free ports on it: {e.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr[0]
