"""`mpirun -np 2 python examples/digits/train.py` with Open MPI: the job trains and ends with the same
parameters as `conveyor run -n 2` of the same job, whether the rendezvous address comes from
MASTER_ADDR/MASTER_PORT or is agreed through mpi4py; with neither, every rank names both fixes.

Through mpi4py the two ranks run on two hosts (network namespaces, conveyor.testing.hosts) where they
can be made, reached by an rsh agent that enters the host's namespace instead of ssh: rank 0 must
then find an address the other host reaches. The runs start together when the module's first test
asks for them (each takes ~10 s of CPU, mostly importing torch), and each test waits for its own.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from safetensors.numpy import load_file

from conveyor.cluster.variables import DATA_DIR_VAR, OUTPUT_DIR_VAR
from conveyor.launch.ports import free_ports
from conveyor.testing.hosts import Hosts, unavailable

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "digits" / "train.py"
JOB = ["--epochs", "2"]
MPIRUN = shutil.which("mpirun")
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None


def _open_mpi() -> str | None:
    """Why the tests cannot drive this machine's mpirun, or None when it is Open MPI's."""
    if MPIRUN is None:
        return "mpirun is not installed (Debian: openmpi-bin and libopenmpi-dev; `make sysdeps` installs them as root)"
    try:
        version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`mpirun --version` failed: {e}"
    return None if "Open MPI" in version else f"these tests use Open MPI's mpirun flags; found {version[:80]!r}"


NOT_OPEN_MPI = _open_mpi()
NO_MPI4PY = "mpi4py is not installed (pip install 'conveyor[mpi]'; `make sysdeps` installs it as root)"
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(NOT_OPEN_MPI is not None, reason=NOT_OPEN_MPI or "")]


def base_env() -> dict[str, str]:
    """This process's environment without any launcher's variables; one intra-op thread per process,
    so that the runs compute alike whatever the machine's core count."""
    foreign = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")
    env = {k: v for k, v in os.environ.items()
           if k not in foreign and not k.startswith(("CONVEYOR_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI", "MPI_"))}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path[1:]])}


def mpirun(*exports: str) -> list[str]:
    """mpirun for 2 local ranks: as root (containers, CI) it must be allowed; the cores may be fewer than
    the ranks and are shared with other tests (no binding); CMA single copies need ptrace, which
    containers often refuse."""
    argv = [MPIRUN, "-np", "2", "--oversubscribe", "--bind-to", "none",
            "--mca", "btl_vader_single_copy_mechanism", "none"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    for export in exports:
        argv += ["-x", export]
    return argv


def across_hosts(hosts: Hosts, folder: Path) -> list[str]:
    """mpirun's options to start one rank on each of ``hosts``: a host file, and an rsh agent that runs
    the daemon's command in the host's namespace, where ssh would log in to the host."""
    agent = folder / "netns-rsh"
    cases = "".join(f"    {host.name}) ns={host.netns} ;;\n" for host in hosts)
    agent.write_text(f"""#!/bin/sh
host=$1; shift
case $host in
{cases}    *) echo "netns-rsh: no host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
""")
    agent.chmod(0o755)
    hostfile = folder / "hostfile"
    hostfile.write_text("".join(f"{host.name} slots=1\n" for host in hosts))
    return ["--hostfile", str(hostfile), "--mca", "plm_rsh_agent", str(agent), "--display-map"]


class Runs:
    """The module's runs, started together on first use; ``result(name)`` waits for one: (status, output)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.procs: dict[str, subprocess.Popen] = {}
        self.results: dict[str, tuple[int, str]] = {}
        self.hosts: Hosts | None = None

    def start(self) -> None:
        env = base_env()
        ref = self.base / "reference"
        self._popen("reference", [sys.executable, "-m", "conveyor.cli.main", "run", "-n", "2", "--data-dir",
                                  str(ref / "data"), "--output-dir", str(ref / "out"), str(SCRIPT), *JOB], env)
        port = free_ports(1)[0]
        self._popen("master", [*mpirun("MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}"), sys.executable,
                               str(SCRIPT), *JOB], self._job_env(env, "master"))
        if HAVE_MPI4PY:
            train = [sys.executable, str(SCRIPT), *JOB]
            if unavailable() is None:
                self.hosts = Hosts(2)
                argv = self.hosts.command(self.hosts[0], [*mpirun(), *across_hosts(self.hosts, self.base), *train])
            else:
                argv = [*mpirun(), *train]
            self._popen("mpi4py", argv, self._job_env(env, "mpi4py"))
        hidden = self.base / "no-mpi4py"  # an mpi4py that cannot be imported, first on the path
        (hidden / "mpi4py").mkdir(parents=True)
        (hidden / "mpi4py" / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
        self._popen("neither", [*mpirun(), sys.executable, "-c", "import conveyor; conveyor.init()"],
                    env | {"PYTHONPATH": os.pathsep.join([str(hidden), env["PYTHONPATH"]])})

    def result(self, name: str) -> tuple[int, str]:
        if not self.procs:
            self.start()
        if name not in self.results:
            proc = self.procs[name]
            try:
                out, _ = proc.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                self.stop()
                out, _ = proc.communicate()
                pytest.fail(f"{name}: still running after 240 s\n{out[-3000:]}")
            self.results[name] = (proc.returncode, out)
        return self.results[name]

    def out(self, name: str) -> Path:
        return self.base / name / "out"

    def stop(self) -> None:
        if self.hosts is not None:
            self.hosts.close()  # kills whatever still runs on the hosts
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
                except psutil.NoSuchProcess:
                    family = []
                for p in family:
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
            proc.communicate()

    def _job_env(self, env: dict[str, str], name: str) -> dict[str, str]:
        return env | {DATA_DIR_VAR: str(self.base / name / "data"), OUTPUT_DIR_VAR: str(self.out(name))}

    def _popen(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        # A TMPDIR per run: mpiruns started together race to create Open MPI's session directory
        # /tmp/ompi.<host>.<uid>, and the loser fails at orte_init with "mkdir ... File exists".
        tmp = self.base / name / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        self.procs[name] = subprocess.Popen(argv, env=env | {"TMPDIR": str(tmp)}, cwd=self.base,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = Runs(tmp_path_factory.mktemp("mpi"))
    yield runs
    runs.stop()


def final_parameters(out: Path) -> dict:
    latest = (out / "checkpoints" / "latest").read_text().strip()
    return load_file(str(out / "checkpoints" / latest / "model.safetensors"))


def assert_same_as_conveyor_run(runs: Runs, name: str) -> None:
    status, log = runs.result(name)
    assert status == 0, log[-3000:]
    ref_status, ref_log = runs.result("reference")
    assert ref_status == 0, ref_log[-3000:]
    got, want = final_parameters(runs.out(name)), final_parameters(runs.base / "reference" / "out")
    assert got.keys() == want.keys()
    for key in want:
        assert (got[key] == want[key]).all(), f"{key} differs from conveyor run's"


def test_master_variables_from_mpirun_x(runs):
    assert_same_as_conveyor_run(runs, "master")
    assert "over 2 worker(s)" in runs.result("master")[1]


@pytest.mark.skipif(not HAVE_MPI4PY, reason=NO_MPI4PY)
def test_rendezvous_agreed_through_mpi4py(runs):
    assert_same_as_conveyor_run(runs, "mpi4py")
    if runs.hosts is not None:  # mpirun's job map: rank 1 ran on the other host
        assert "Data for node: host1" in runs.result("mpi4py")[1]


def test_without_master_variables_or_mpi4py_every_rank_says_what_to_set(runs):
    status, log = runs.result("neither")
    assert status != 0
    for rank in (0, 1):
        assert (f"ClusterConfigError: this process is rank {rank} of 2 of an MPI job, but MASTER_ADDR and "
                f"MASTER_PORT are not set") in log, log[-3000:]
    assert "`mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ...`" in log
    assert "pip install 'conveyor[mpi]'" in log
