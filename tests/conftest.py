"""Fixtures shared by every test folder, and each xdist worker's own port range (docs/testing.md)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from conveyor.cluster.variables import FAST_EXIT_VAR
from conveyor.launch.ports import PORT_RANGE_VAR
from conveyor.testing.hosts import Hosts, unavailable

ROOT = Path(__file__).resolve().parents[1]
# The ports below the kernel's ephemeral range that the workers of a parallel run share out.
_FIRST_PORT = 10000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def pytest_configure(config):
    """Every task a test starts leaves without the collector's passes over torch (conveyor.exiting, ~1 CPU-s a
    task). Warm starts (launch/warm.py) stay off, as a user gets them, unless CONVEYOR_WARM_START is set: tests
    find a job's tasks by their command line and environment, which a warm task shows as its template's
    (docs/launcher.md, Warm starts); tests/launch/test_warm.py turns them on where it tests them. Under
    pytest-xdist, give this worker (gw<i> of n) its own slice of the ports below the ephemeral range: every
    free_ports() of its tests and of the launchers they start (the variable is inherited) comes from it, so two
    workers never hand out one port, and no outgoing connection's source port takes one meanwhile."""
    os.environ.setdefault(FAST_EXIT_VAR, "1")
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit() or PORT_RANGE_VAR in os.environ:
        return
    size = (_ephemeral_low() - _FIRST_PORT) // max(int(count), 1)
    if size >= 100:
        low = _FIRST_PORT + int(worker[2:]) * size
        os.environ[PORT_RANGE_VAR] = f"{low}-{low + size - 1}"


@pytest.fixture
def make_hosts():
    """``make_hosts(count, rate_mbit=None, names=None, private_hostnames=False) -> Hosts``: hosts as network
    namespaces (conveyor.testing.hosts), removed after the test whatever its outcome; skips where namespaces
    cannot be made (not root)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    made: list[Hosts] = []

    def make(count: int, **kwargs) -> Hosts:
        made.append(Hosts(count, **kwargs))
        return made[-1]

    yield make
    for hosts in made:
        hosts.close()



@pytest.fixture(scope="session")
def digits_data(tmp_path_factory) -> Path:
    """A --data-dir holding the digits example's TFRecord shards (``digits/``), written once per session (per xdist
    worker) here, for every test file that runs the example: otherwise the first job of each file has its chief
    import scikit-learn and convert them again (seconds of CPU). The jobs only read it."""
    pytest.importorskip("sklearn", reason="the digits come from scikit-learn (pip install 'conveyor[examples]')")
    folder = tmp_path_factory.mktemp("digits-data")
    spec = importlib.util.spec_from_file_location("digits_train", ROOT / "examples" / "digits" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_tfrecords(str(folder / "digits"))
    return folder
