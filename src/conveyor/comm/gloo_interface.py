"""Which network interface gloo listens on: the one holding this task's address in the cluster spec.

    name = interface_for(spec, task)      # "eth0", or None: leave gloo to its default
    if name and GLOO_IFNAME_VAR not in os.environ:
        os.environ[GLOO_IFNAME_VAR] = name

Left to itself, gloo listens at the address this machine's *hostname* resolves to, and tells the other
ranks to connect there. Where ``/etc/hosts`` maps the hostname to ``127.0.1.1`` (Debian's and Ubuntu's
default), every other machine is then told to connect to its own loopback, and the process group never
forms. The cluster spec already says where each task is reachable (the launcher writes the address the
rendezvous saw), so a task tells gloo that address's interface through ``GLOO_SOCKET_IFNAME`` (torch's
own setting: one the caller set wins). A loopback address counts only when the spec names it as such
(a job on one machine): a *name* that resolves to loopback here is the trap above, not an answer.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

from conveyor.cluster.spec import ClusterSpec, TaskId, split_address

__all__ = ["GLOO_IFNAME_VAR", "interface_for", "interface_of"]

GLOO_IFNAME_VAR = "GLOO_SOCKET_IFNAME"


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds the IP ``address``, or None."""
    wanted = ipaddress.ip_address(address)
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(a.address.split("%")[0]) == wanted:
                        return name
                except ValueError:
                    continue
    return None


def interface_for(spec: ClusterSpec, task: TaskId) -> str | None:
    """The interface gloo should listen on for ``task``: the one holding its cluster address; None when
    the address is not this machine's (behind NAT), or a name that resolves only to loopback here."""
    host, _ = split_address(spec.task_address(task.type, task.index))
    try:
        return interface_of(str(ipaddress.ip_address(host)))  # a literal: as the spec says, loopback too
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None  # gloo's default; the store's own checks name an address that does not resolve
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if not address.is_loopback:
            name = interface_of(str(address))
            if name is not None:
                return name
    return None
