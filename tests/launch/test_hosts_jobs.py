"""`conveyor run --nnodes 3` over three hosts with addresses, names and hosts files of their own.

The hosts are network namespaces (conveyor.testing.hosts); every launcher is started on its host with
`--rdzv host0:PORT`, so the name is resolved on each. They share the filesystem, as nodes sharing the
job's data and output folders over NFS do. What must hold: the digits demo trains to exactly the
parameters of a one-machine run of the same job (allreduce, and ps-sync with the ps on a host of its
own: -n 0 --ps 1); every server listens on its host's address only, and the cluster names each host's
address; one host's tasks killed restarts the job everywhere from the last checkpoint, to the same
parameters; a host lost outright, or one that never joins, ends the job within about --timeout naming
it; a name that does not resolve, or resolves to loopback on node 0, fails at once.

Host1's hosts file maps its own name to 127.0.1.1 (Debian's default), and the subnet sorts above
127.x: gloo then asks the others to connect to host1, at the address its hostname resolves to, unless
conveyor tells gloo the interface of host1's cluster address (comm/gloo_interface.py).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "digits" / "train.py"
PORT = 29400
TRAIN = ("--epochs", "1", "--batch-size", "64", "--checkpoint-every", "2")  # 5 steps at world size 4, 11 at 2
SUBNET = "192.168.77"  # above 127.x: see the module docstring
JOBS = {  # strategy: each node's task flags, and the same job on one machine
    "allreduce": ([("-n", "2"), ("-n", "1"), ("-n", "1")], ("-n", "4")),
    "ps-sync": ([("-n", "1"), ("-n", "1"), ("-n", "0", "--ps", "1")], ("-n", "2", "--ps", "1")),
}

# One intra-op thread in every task, on every host: torch sums inside a convolution in an order that depends
# on its thread count, and a host with one task would otherwise give it every core (the one-machine run, 1).
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# serial: three namespace hosts of 1-2 tasks each, and how soon a lost host ends the job is asserted in wall time
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.serial]


def conveyor_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "conveyor.cli.main", "run", *args]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The digits as TFRecord shards, written once for every job here (the chief would write them too)."""
    folder = tmp_path_factory.mktemp("shared") / "data"
    spec = importlib.util.spec_from_file_location("digits_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_tfrecords(str(folder / "digits"))
    return folder


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory, data):
    """The final parameters of the same job run by one launcher on this machine, per strategy."""
    runs: dict[str, dict] = {}

    def run(strategy: str) -> dict:
        if strategy not in runs:
            out = tmp_path_factory.mktemp(f"one-{strategy}") / "out"
            done = subprocess.run(conveyor_run(*JOBS[strategy][1], "--strategy", strategy, "--data-dir", str(data),
                                               "--output-dir", str(out), str(SCRIPT), *TRAIN),
                                  capture_output=True, text=True, timeout=180, env=ENV)
            assert done.returncode == 0, done.stderr[-3000:]
            runs[strategy] = final_parameters(out)
        return runs[strategy]

    return run


def final_parameters(out: Path) -> dict:
    latest = (out / "checkpoints" / "latest").read_text().strip()
    return load_file(str(out / "checkpoints" / latest / "model.safetensors"))


class Job:
    """The launchers of one job, one per host, each with its output in ``node<rank>.log``."""

    def __init__(self, hosts, tmp_path: Path, data: Path, strategy: str, *, timeout: float = 60) -> None:
        self.hosts, self.tmp = hosts, tmp_path
        self.out = tmp_path / "out"
        secret = tmp_path / "job.secret"
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o600)
        self.argv = [conveyor_run("--nnodes", "3", "--node-rank", str(rank), *flags, "--strategy", strategy,
                                  "--rdzv", f"host0:{PORT}", "--job-secret-file", str(secret), "--timeout",
                                  f"{timeout:g}", "--max-restarts", "1", "--restart-delay", "0.2", "--data-dir",
                                  str(data), "--output-dir", str(self.out), str(SCRIPT), *TRAIN)
                     for rank, flags in enumerate(JOBS[strategy][0])]
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, *ranks: int) -> None:
        for rank in ranks or range(3):
            with open(self.tmp / f"node{rank}.log", "w") as log:
                self.procs[rank] = self.hosts.popen(self.hosts[rank], self.argv[rank], cwd=self.tmp, stdout=log,
                                                    stderr=subprocess.STDOUT, env=ENV)

    def wait(self, timeout: float = 150) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        try:
            return {r: p.wait(timeout=max(0.1, deadline - time.monotonic())) for r, p in self.procs.items()}
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launchers still run after {timeout:g} s\n{self.logs()}")

    def log(self, rank: int) -> str:
        return (self.tmp / f"node{rank}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"--- node {r}\n{self.log(r)[-3000:]}" for r in self.procs)

    def wait_for_line(self, rank: int, text: str, timeout: float = 120) -> float:
        """When ``text`` appeared in node ``rank``'s output (polled every 20 ms)."""
        deadline = time.monotonic() + timeout
        while text not in self.log(rank):
            assert time.monotonic() < deadline and self.procs[rank].poll() is None, self.logs()
            time.sleep(0.02)
        return time.monotonic()

    def first_checkpoint(self, timeout: float = 120) -> int:
        """Wait for the first complete checkpoint; its step."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = sorted((self.out / "checkpoints").glob("step-*"))
            if steps:
                return int(steps[0].name.removeprefix("step-"))
            if all(p.poll() is not None for p in self.procs.values()):
                break
            time.sleep(0.02)
        pytest.fail(f"no checkpoint appeared\n{self.logs()}")

    def tasks(self, rank: int, timeout: float = 60) -> list[psutil.Process]:
        """Node ``rank``'s task processes of the first attempt, once all of them have started."""
        want = sum(int(v) for k, v in zip(self.argv[rank], self.argv[rank][1:], strict=False) if k in ("-n", "--ps"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [p for p in psutil.Process(self.procs[rank].pid).children(recursive=True) if _first_task(p)]
            if len(found) == want:
                return found
            time.sleep(0.02)
        pytest.fail(f"node {rank}'s {want} task(s) did not start\n{self.logs()}")

    def cluster(self, rank: int) -> dict:
        line = re.search(r"\[conveyor\] node \d of 3: cluster (\{.*\})", self.log(rank))
        assert line, self.log(rank)
        return ast.literal_eval(line.group(1))


def _first_task(p: psutil.Process) -> bool:
    try:
        env = p.environ()
        return "CONVEYOR_TASK_TYPE" in env and env.get("CONVEYOR_RESTART_COUNT") == "0" and str(SCRIPT) in p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def listening(hosts, host) -> list[tuple[str, int]]:
    """Every TCP socket listening on ``host``, as (address, port)."""
    out = hosts.run(host, ["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    return [(a.rsplit(":", 1)[0].strip("[]"), int(a.rsplit(":", 1)[1])) for a in (line.split()[3] for line in
                                                                                 out.splitlines())]


def debian_hosts_file(hosts, host) -> None:
    path = hosts.hosts_file(host)
    path.write_text(f"127.0.1.1\t{host.name}\n" + path.read_text())


def check_addresses(job: Job, hosts, listeners: dict) -> None:
    """Every launcher derived the same cluster of the hosts' addresses; every server listens on its host's."""
    cluster = job.cluster(0)
    assert job.cluster(1) == job.cluster(2) == cluster
    a0, a1, a2 = (h.address for h in hosts)
    if "ps" in cluster:
        assert [w.rsplit(":", 1)[0] for w in cluster["worker"]] == [a0, a1]
        assert [p.rsplit(":", 1)[0] for p in cluster["ps"]] == [a2]
        assert (a2, int(cluster["ps"][0].rsplit(":", 1)[1])) in listeners["host2"]
    else:
        assert [w.rsplit(":", 1)[0] for w in cluster["worker"]] == [a0, a0, a1, a2]
    assert (a0, PORT) in listeners["host0"]
    for host in hosts:  # the rendezvous store, rank 0's store, gloo's pairs, the ps: on the host's address only
        assert listeners[host.name] and {a for a, _ in listeners[host.name]} == {host.address}, listeners


def assert_same_parameters(got: dict, want: dict, than: str) -> None:
    assert got.keys() == want.keys()
    for name in want:  # the same sums in the same order: bit for bit, whatever the transport
        assert (got[name] == want[name]).all(), f"{name} differs from {than}"


def test_allreduce_on_three_hosts_trains_to_the_parameters_of_one_machine(make_hosts, tmp_path, data, one_machine):
    hosts = make_hosts(3, subnet=SUBNET)
    debian_hosts_file(hosts, hosts[1])
    job = Job(hosts, tmp_path, data, "allreduce")
    job.start()
    job.first_checkpoint()
    listeners = {h.name: listening(hosts, h) for h in hosts}  # while every task runs
    assert set(job.wait().values()) == {0}, job.logs()
    check_addresses(job, hosts, listeners)
    assert_same_parameters(final_parameters(job.out), one_machine("allreduce"), "the one-machine run")


def test_a_ps_host_of_its_own_and_one_hosts_tasks_killed_end_at_the_uninterrupted_parameters(
        make_hosts, tmp_path, data, one_machine):
    """ps-sync with host2 running the ps alone (-n 0 --ps 1); host1's worker is killed after the first checkpoint,
    and every host restarts from it. One run for both (the suite's time): the first attempt is the uninterrupted
    three-host run up to the kill, and the result must be the uninterrupted one-machine run's, bit for bit.
    ps-sync because its sums (two workers' gradients, on the ps) come out the same in any order: with more than
    two all-reduce workers, DDP's first step after a resume reduces its gradient bucket in the layout it starts
    with, not the one it rebuilt after its first step, so gloo's ring adds in another order (differences ~1e-8)."""
    hosts = make_hosts(3, subnet=SUBNET)
    debian_hosts_file(hosts, hosts[1])
    job = Job(hosts, tmp_path, data, "ps-sync")
    job.start()
    victims = job.tasks(1)  # worker:1, on host1; host2's ps and host0's worker:0 restart with it
    step = job.first_checkpoint()
    listeners = {h.name: listening(hosts, h) for h in hosts}
    for p in victims:
        p.send_signal(signal.SIGKILL)
    assert set(job.wait().values()) == {0}, job.logs()
    check_addresses(job, hosts, listeners)
    assert "worker:1 was killed by SIGKILL on node 1" in job.log(0) + job.log(2)
    for rank in range(3):
        assert "[conveyor] job finished after 1 restart(s)" in job.log(rank)
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from_step"] >= step
    assert_same_parameters(final_parameters(job.out), one_machine("ps-sync"), "the uninterrupted run")


def test_a_host_lost_outright_ends_the_job_everywhere_naming_it(make_hosts, tmp_path, data):
    timeout = 10
    hosts = make_hosts(3, subnet=SUBNET)
    job = Job(hosts, tmp_path, data, "allreduce", timeout=timeout)
    job.start()
    survivors = job.tasks(0) + job.tasks(2)
    job.first_checkpoint()
    hosts.kill_host(hosts[1])  # the launcher too: nobody is left there to say anything
    lost = time.monotonic()
    codes = job.wait(timeout=timeout + 60)
    elapsed = time.monotonic() - lost
    assert codes[0] == codes[2] == 1, job.logs()
    assert elapsed < timeout + 30, f"took {elapsed:.0f} s\n{job.logs()}"  # the slack: a loaded machine
    for rank in (0, 2):
        assert f"lost node 1 (host1 at {hosts[1].address}): no heartbeat" in job.log(rank), job.logs()
    assert not [p for p in survivors if alive(p)], "tasks outlived their launcher"


def test_a_host_that_never_joins_fails_the_others_within_the_timeout_naming_it(make_hosts, tmp_path, data):
    hosts = make_hosts(3)
    job = Job(hosts, tmp_path, data, "allreduce", timeout=5)
    job.start(0, 1)  # host2's launcher never starts
    joined = [job.wait_for_line(rank, "joined the rendezvous at") for rank in (0, 1)]  # --timeout runs from there
    codes = job.wait(timeout=60)
    ended = time.monotonic()
    assert set(codes.values()) == {1}, job.logs()
    # node 0 then keeps the store up to 5 s for node 1 to read why
    assert ended - max(joined) < 5 + 5 + 10, f"{ended - max(joined):.0f} s\n{job.logs()}"
    for rank in (0, 1):
        assert f"rendezvous at host0:{PORT}: node(s) 2 of 3 did not join within 5 s" in job.log(rank)


def test_a_name_that_cannot_work_fails_at_once_naming_it_and_the_fix(make_hosts, tmp_path):
    hosts = make_hosts(2)
    debian_hosts_file(hosts, hosts[0])
    (tmp_path / "task.py").write_text("print('never')\n")
    common = ("--job-secret-file", str(tmp_path / "s"), "--timeout", "300", str(tmp_path / "task.py"))
    (tmp_path / "s").write_text("ab" * 32)
    (tmp_path / "s").chmod(0o600)
    started = time.monotonic()
    unknown = hosts.run(hosts[1], conveyor_run("--nnodes", "2", "--node-rank", "1", "--rdzv", f"nosuchhost:{PORT}",
                                               *common), capture_output=True, text=True, cwd=tmp_path)
    loopback = hosts.run(hosts[0], conveyor_run("--nnodes", "2", "--node-rank", "0", "--rdzv", f"host0:{PORT}",
                                                *common), capture_output=True, text=True, cwd=tmp_path)
    assert time.monotonic() - started < 90  # far below --timeout 300: nothing waited for anybody
    assert unknown.returncode == 1 and loopback.returncode == 1
    assert "--rdzv host 'nosuchhost' does not resolve here" in unknown.stderr, unknown.stderr
    assert f"--rdzv 10.0.0.1:{PORT}, or a name every node resolves" in unknown.stderr
    assert "'host0' resolves to 127.0.1.1 on this machine (node 0), a loopback address" in loopback.stderr
    assert "/etc/hosts" in loopback.stderr
