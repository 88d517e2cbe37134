"""Several hosts on one machine, for tests and benchmarks: network namespaces on a private switch.

    with Hosts(3, rate_mbit=1000) as hosts:           # host0..host2 at 10.77.0.1..3, 1 Gbit/s links
        proc = hosts.popen(hosts[0], ["python", "-c", "import socket; print(socket.gethostname())"])
    Hosts(2, names=[("job-w-0", "job-w-0.job"), ("job-w-1", "job-w-1.job")], private_hostnames=True)

Each host is a network namespace with its own address, loopback, hostname (a UTS namespace per command)
and hosts file (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``) naming every
host of the set (``names``: other hostnames, and aliases; ``private_hostnames``: a hostname resolves on its
own host only, the others use its aliases, as Kubernetes pods' names do). The hosts' links meet on a
bridge inside a namespace of its own, never the machine's: nothing outside the set can reach them, they
can reach nothing outside it, and two sets never collide even with the same addresses. ``rate_mbit``
caps every link in both directions with ``tc … tbf`` (no latency emulation: this kernel has no ``netem``).
:meth:`Hosts.close` (also on an exception inside the ``with``) kills every process still in the namespaces
and removes everything it made; sets left by a process that was killed are removed by the next set made
on the machine (:func:`remove_stale`).
Needs root and iproute2: :func:`unavailable` says why not, for a test to skip with.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Host", "Hosts", "HostsError", "remove_stale", "unavailable"]

PREFIX = "cvh"  # every namespace, link and hosts folder this module makes starts with it
NETNS_ETC = Path("/etc/netns")
_IP_TIMEOUT = 10.0


class HostsError(RuntimeError):
    """A namespace, link or cap could not be made; the message has the command and what it printed."""


@dataclass(frozen=True)
class Host:
    """One host of a :class:`Hosts` set: its name (also its hostname), address, namespace and other names."""

    name: str
    address: str
    netns: str
    aliases: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.name} ({self.address})"


def unavailable() -> str | None:
    """Why hosts cannot be made here (for ``pytest.skip``), or ``None`` when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"network namespaces need {', '.join(missing)} (Debian: apt-get install iproute2 util-linux)"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostsError(f"`{' '.join(argv)}` failed: {e}") from e
    if check and done.returncode != 0:
        raise HostsError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]


def _kill_all(netns: str) -> None:
    """SIGKILL every process in ``netns``, and wait (bounded) until none is left."""
    deadline = time.monotonic() + _IP_TIMEOUT
    while time.monotonic() < deadline:
        pids = [int(p) for p in _run("ip", "netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _remove(tag: str) -> None:
    """Remove every namespace and hosts folder of the set ``tag``; deleting a namespace deletes its links."""
    for ns in _namespaces():
        if ns.startswith(tag):
            _kill_all(ns)
            _run("ip", "netns", "del", ns, check=False)
    for folder in NETNS_ETC.glob(f"{tag}*"):
        shutil.rmtree(folder, ignore_errors=True)


def remove_stale() -> None:
    """Remove the sets of processes that no longer run (a test runner killed with SIGKILL)."""
    owners = {ns[len(PREFIX):].split("x")[0] for ns in _namespaces() if ns.startswith(PREFIX)}
    for owner in owners:
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _remove(f"{PREFIX}{owner}x")


_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _host_names(count: int, names: Sequence[str | Sequence[str]] | None) -> list[tuple[str, ...]]:
    """Each host's (hostname, *aliases), checked: a bad name would fail later as an unresolved host."""
    if names is None:
        return [(f"host{i}",) for i in range(count)]
    if len(names) != count:
        raise ValueError(f"names has {len(names)} entries for {count} hosts; give one per host")
    named = [(entry,) if isinstance(entry, str) else tuple(entry) for entry in names]
    seen: set[str] = set()
    for i, entry in enumerate(named):
        if not entry or not _HOSTNAME.fullmatch(entry[0]):
            raise ValueError(f"names[{i}] = {entry!r}: the hostname must be a DNS label (letters, digits, '-', "
                             f"at most 63 characters)")
        for name in entry:
            labels = name.split(".")
            if not all(_HOSTNAME.fullmatch(label) for label in labels) or len(name) > 253:
                raise ValueError(f"names[{i}]: {name!r} is not a host name (DNS labels joined by dots)")
            if name.lower() in seen:
                raise ValueError(f"names[{i}]: {name!r} names two hosts")
            seen.add(name.lower())
    return named


class Hosts:
    """``count`` hosts ``host0``… at ``10.77.0.1``…; see the module docstring. Use as a context manager.

    ``names[i]`` is host i's hostname, or ``(hostname, alias, ...)``: names every host resolves to it
    (default ``host<i>``). ``private_hostnames=True``: a hostname resolves only on its own host.
    """

    _made = 0  # sets made by this process, so that two sets of one process get different names

    def __init__(self, count: int, *, rate_mbit: float | None = None, subnet: str = "10.77.0",
                 names: Sequence[str | Sequence[str]] | None = None, private_hostnames: bool = False) -> None:
        if not 1 <= count <= 200:
            raise ValueError(f"count={count}: a set has 1 to 200 hosts")
        named = _host_names(count, names)
        reason = unavailable()
        if reason:
            raise HostsError(reason)
        remove_stale()
        Hosts._made += 1
        self.tag = f"{PREFIX}{os.getpid()}x{Hosts._made}"
        self.switch = f"{self.tag}s"
        self.private_hostnames = private_hostnames
        self.hosts = [Host(name, f"{subnet}.{i + 1}", f"{self.tag}h{i}", tuple(aliases))
                      for i, (name, *aliases) in enumerate(named)]
        try:
            self._make(rate_mbit)
        except BaseException:
            self.close()
            raise

    def _make(self, rate_mbit: float | None) -> None:
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            outer = f"port{i}"  # made inside the switch's namespace: the machine's own links never see it
            _run("ip", "netns", "add", host.netns)
            _run("ip", "-n", self.switch, "link", "add", outer, "type", "veth", "peer", "name", "eth0",
                 "netns", host.netns)
            _run("ip", "-n", self.switch, "link", "set", outer, "master", "br0", "up")
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
            folder = NETNS_ETC / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(self._hosts_file(host))
            (folder / "hostname").write_text(host.name + "\n")
        if rate_mbit is not None:
            self.cap(rate_mbit)

    def _hosts_file(self, me: Host) -> str:
        """``me``'s /etc/hosts: every host by its aliases, and by its hostname unless that is private."""
        lines = ["127.0.0.1\tlocalhost"]
        for h in self.hosts:
            names = h.aliases if self.private_hostnames and h is not me else (h.name, *h.aliases)
            if names:
                lines.append(f"{h.address}\t{' '.join(names)}")
        return "\n".join(lines) + "\n"

    def cap(self, rate_mbit: float | None) -> None:
        """Cap every host's link at ``rate_mbit`` in both directions (``None``: remove the caps)."""
        for i, host in enumerate(self.hosts):
            for ns, dev in ((host.netns, "eth0"), (self.switch, f"port{i}")):  # out of, and into, the host
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                if rate_mbit is not None:
                    # The bucket holds at least 4 ms at the rate and one 64 KiB segment (veth offloads send
                    # 64 KiB at a time; tbf drops any packet larger than its bucket).
                    burst = max(int(rate_mbit * 1e6 / 8 * 0.004), 256 * 1024)
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms")

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``host``: in its network namespace, with its hosts file and its hostname."""
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', host.name, *argv]

    def popen(self, host: Host, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``host``; :meth:`close` kills it if it is still running then."""
        return subprocess.Popen(self.command(host, argv), env=None if env is None else dict(env), **kwargs)

    def run(self, host: Host, argv: Sequence[str], *, timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to the end (at most ``timeout`` seconds)."""
        return subprocess.run(self.command(host, argv), timeout=timeout, **kwargs)

    def hosts_file(self, host: Host) -> Path:
        """``host``'s ``/etc/hosts``, to edit before starting commands there (Debian's ``127.0.1.1 <name>``)."""
        return NETNS_ETC / host.netns / "hosts"

    def kill_host(self, host: Host) -> None:
        """SIGKILL every process on ``host``, as if the machine had lost power."""
        _kill_all(host.netns)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self):
        return iter(self.hosts)

    def close(self) -> None:
        _remove(self.tag)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
