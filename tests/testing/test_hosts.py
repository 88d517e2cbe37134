"""The test hosts: own addresses and names, reachable only from each other, capped links, nothing left over."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conveyor.testing.hosts import Hosts, _namespaces

SINK = textwrap.dedent("""
    import socket, sys
    server = socket.create_server(("0.0.0.0", 5000))
    print("ready", flush=True)
    conn, (addr, _) = server.accept()
    total = 0
    while chunk := conn.recv(1 << 20):
        total += len(chunk)
    print(total, addr)
""")
SEND = textwrap.dedent("""
    import socket, sys, time
    conn = socket.create_connection((sys.argv[1], 5000), timeout=10)
    start, block = time.perf_counter(), b"x" * (1 << 20)
    for _ in range(int(sys.argv[2])):
        conn.sendall(block)
    conn.close()
    print(int(sys.argv[2]) * len(block) * 8 / 1e6 / (time.perf_counter() - start))
""")


def _sink(hosts: Hosts, index: int) -> subprocess.Popen:
    proc = hosts.popen(hosts[index], [sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_hosts_have_their_own_names_and_addresses_and_resolve_each_other(make_hosts):
    hosts = make_hosts(2)
    out = hosts.run(hosts[0], ["sh", "-c", "hostname; getent hosts host1; ip -br -4 addr show eth0"],
                    capture_output=True, text=True, check=True).stdout.split()
    assert out[:3] == ["host0", "10.77.0.2", "host1"] and "10.77.0.1/24" in out
    sink = _sink(hosts, 1)
    hosts.run(hosts[0], [sys.executable, "-c", SEND, "host1", "1"], check=True, capture_output=True)
    assert sink.communicate(timeout=30)[0].split() == [str(1 << 20), "10.77.0.1"]


def test_a_host_cannot_reach_the_machine_or_another_set(make_hosts):
    first, second = make_hosts(1), make_hosts(2)
    sink = _sink(second, 1)  # 10.77.0.2 in the second set; the first set has no such host
    done = first.run(first[0], [sys.executable, "-c", SEND, "10.77.0.2", "1"], capture_output=True, text=True)
    assert done.returncode != 0 and "No route to host" in done.stderr
    sink.kill()


def test_a_capped_link_carries_about_its_rate(make_hosts):
    hosts = make_hosts(2, rate_mbit=200)
    sink = _sink(hosts, 1)
    mbit = float(hosts.run(hosts[0], [sys.executable, "-c", SEND, "host1", "40"], capture_output=True, text=True,
                           check=True).stdout)
    sink.communicate(timeout=30)
    assert 0.7 * 200 < mbit < 1.1 * 200


def test_close_kills_what_runs_and_removes_everything_also_after_an_error():
    from conveyor.testing.hosts import unavailable

    if unavailable():
        pytest.skip(unavailable())
    with pytest.raises(RuntimeError, match="inside"):
        with Hosts(2) as hosts:
            proc = hosts.popen(hosts[0], ["sleep", "600"])
            raise RuntimeError("a test failed inside")
    assert proc.wait(timeout=10) != 0
    assert not [ns for ns in _namespaces() if ns.startswith(hosts.tag)]


def test_named_hosts_resolve_by_their_aliases_and_keep_their_hostnames_private(make_hosts):
    hosts = make_hosts(2, names=[("job-w-0", "job-w-0.job"), ("job-w-1", "job-w-1.job", "w1.example")],
                       private_hostnames=True)
    script = ("import socket\nfor n in ['job-w-1.job', 'w1.example', 'job-w-0', 'job-w-1']:\n"
              "    try: print(n, socket.gethostbyname(n))\n    except OSError: print(n, '-')\n"
              "print(socket.gethostname())")
    out = hosts.run(hosts[0], [sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:5] == ["job-w-1.job 10.77.0.2", "w1.example 10.77.0.2", "job-w-0 10.77.0.1",
                                   "job-w-1 -", "job-w-0"]
    assert hosts[1].aliases == ("job-w-1.job", "w1.example")


def test_bad_names_are_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="one per host"):
        Hosts(2, names=["a"])
    with pytest.raises(ValueError, match="names two hosts"):
        Hosts(2, names=[("a", "x.y"), ("b", "x.y")])
    with pytest.raises(ValueError, match="DNS label"):
        Hosts(1, names=["a.b"])
