"""A real Slurm cluster on one machine, for tests: munge, slurmctld and one slurmd per namespace host.

    with SlurmCluster(3) as cluster:                          # nodes host0..host2 at 10.77.0.1..3
        job = cluster.sbatch("job.sbatch")                    # sbatch, run on host0
        assert cluster.wait(job, timeout=120) == "COMPLETED"

Every daemon runs inside the :class:`~conveyor.testing.hosts.Hosts` namespaces: slurmctld and munged on
host0, a slurmd on each host, so node names resolve (each host's /etc/hosts) to real, different
addresses and a job's tasks run with their node's address and hostname. The cluster's files live in
one temporary folder: slurm.conf (root as SlurmUser, proctrack/linuxproc, task/none: no cgroups),
munge's own key and socket (a system munged is never touched), state, spool, logs. :meth:`close`
cancels every job, stops the daemons, kills whatever is left in the namespaces and removes the
folder; it runs on every exit path of the ``with``. :func:`unavailable` says why a cluster cannot
start here (for ``pytest.skip``), after installing Debian's packages when root with apt-get.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from conveyor.testing import hosts as hosts_module
from conveyor.testing.hosts import Hosts

__all__ = ["FINAL_STATES", "SlurmCluster", "SlurmError", "unavailable"]

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")
PACKAGES = ("slurm-wlm", "munge")
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"])
#: A job in one of these states has ended (Slurm's job_state_string names).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                          "DEADLINE", "PREEMPTED"})
_COMMAND_TIMEOUT = 30.0
_FOLDER_PREFIX = "conveyor-slurm-"


class SlurmError(RuntimeError):
    """The cluster did not start or a Slurm command failed; the message has the command's output or the logs."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def _missing() -> list[str]:
    return [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]


def unavailable(*, install: bool = True) -> str | None:
    """Why a cluster cannot start here, or ``None``; with ``install``, root with apt-get installs Slurm first."""
    reason = hosts_module.unavailable()
    if reason:
        return f"a Slurm cluster of namespace hosts: {reason}"
    missing = _missing()
    if missing and install and _which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        argv = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
        if done.returncode != 0:  # a fresh machine's package lists may be empty
            subprocess.run(["apt-get", "update"], capture_output=True, timeout=300, env=env)
            subprocess.run(argv, capture_output=True, timeout=900, env=env)
        missing = _missing()
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing); Debian: apt-get install "
                f"{' '.join(PACKAGES)}")
    return None


def _remove_stale_folders() -> None:
    """Remove the folders of clusters whose process no longer runs (a test runner killed with SIGKILL: its
    namespaces, and so its daemons, are removed by the next :class:`Hosts`)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{_FOLDER_PREFIX}*-*"):
        owner = folder.name[len(_FOLDER_PREFIX):].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def _conf(folder: Path, hosts: Hosts, cpus: int, partitions: Mapping[str, Sequence[int]]) -> str:
    names = ",".join(h.name for h in hosts)
    more = "".join(f"PartitionName={name} Nodes={','.join(hosts[i].name for i in nodes)} MaxTime=INFINITE State=UP\n"
                   for name, nodes in partitions.items())
    return f"""\
# A test cluster made by conveyor.testing.slurm: every daemon as root, no cgroups, files in one folder.
ClusterName=conveyortest
SlurmctldHost={hosts[0].name}({hosts[0].address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
InactiveLimit=0
NodeName={names} CPUs={cpus} State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
{more}"""


class SlurmCluster:
    """``count`` Slurm nodes host0.. on namespace hosts; see the module docstring. Use as a context manager.
    Every node is in partition ``main`` (the default); ``partitions`` adds more, by name: host indexes."""

    def __init__(self, count: int = 3, *, cpus: int = 4, start_timeout: float = 60.0,
                 partitions: Mapping[str, Sequence[int]] | None = None) -> None:
        missing = _missing()
        if missing:
            raise SlurmError(f"Slurm is not installed ({', '.join(missing)} missing)")
        _remove_stale_folders()
        self.folder = Path(tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-"))
        self.folder.chmod(0o711)  # munged wants its socket's folder searchable by every user (clients run as any)
        self.hosts: Hosts | None = None
        self._daemons: list[subprocess.Popen] = []
        self._controller: subprocess.Popen | None = None
        self.env = {**os.environ, "SLURM_CONF": str(self.folder / "slurm.conf"), "PATH": _SEARCH_PATH}
        try:
            self.hosts = Hosts(count)
            self._start(cpus, start_timeout, dict(partitions or {}))
        except BaseException:
            self.close()
            raise

    @property
    def nodes(self) -> list[str]:
        return [h.name for h in self.hosts]

    def _start(self, cpus: int, timeout: float, partitions: Mapping[str, Sequence[int]]) -> None:
        folder, hosts = self.folder, self.hosts
        for sub in ("state", *(f"spool/{h.name}" for h in hosts)):
            (folder / sub).mkdir(parents=True)
        fd = os.open(folder / "munge.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(128))
        (folder / "slurm.conf").write_text(_conf(folder, hosts, cpus, partitions))
        (folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")  # no autodetection: the hosts have no cgroupfs
        self._daemon(hosts[0], "munged", ["munged", "--foreground", f"--socket={folder}/munge.socket",
                                          f"--key-file={folder}/munge.key", f"--pid-file={folder}/munged.pid",
                                          f"--seed-file={folder}/munged.seed", f"--log-file={folder}/munged.log"])
        self._wait(lambda: (folder / "munge.socket").exists(), timeout, "munged never made its socket")
        self._controller = self._daemon(hosts[0], "slurmctld", ["slurmctld", "-D", "-i"])
        for host in hosts:
            self._daemon(host, f"slurmd-{host.name}", ["slurmd", "-D", "-N", host.name])
        self._wait(self._all_idle, timeout, f"the nodes did not all become idle within {timeout:g} s")

    def _daemon(self, host, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.folder / f"{name}.out", "wb") as out:
            self._daemons.append(self.hosts.popen(host, argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL))
        return self._daemons[-1]

    def _all_idle(self) -> bool:
        done = self.run(["sinfo", "--noheader", "--format=%n %t"], check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(name) == "idle" for name in self.nodes)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SlurmError(f"{what}{'; a daemon exited' if dead else ''}\n{self.logs()}")
            time.sleep(0.1)

    def logs(self, lines: int = 15) -> str:
        """The last lines of every daemon's output and log, for an error message."""
        parts = []
        for path in sorted(self.folder.glob("*.out")) + sorted(self.folder.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def run(self, argv: Sequence[str], *, host: int = 0, check: bool = True, timeout: float = _COMMAND_TIMEOUT,
            env: Mapping[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
        """Run a command (``sbatch``, ``scontrol``...) on node ``host`` with this cluster's SLURM_CONF, plus ``env``
        (sbatch passes the environment on to the job)."""
        done = self.hosts.run(self.hosts[host], list(argv), env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout, **kwargs)
        if check and done.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def sbatch(self, script: str | os.PathLike[str], *options: str) -> str:
        """Submit ``script`` from host0; the job id."""
        return self.run(["sbatch", "--parsable", *options, str(script)]).stdout.strip().split(";")[0]

    def state(self, job_id: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED...)."""
        fields = self.run(["scontrol", "--oneliner", "show", "job", job_id]).stdout.split()
        return next(f.split("=", 1)[1] for f in fields if f.startswith("JobState="))

    def wait(self, job_id: str, timeout: float) -> str:
        """Wait (at most ``timeout`` s) until the job has ended; its final state."""
        deadline = time.monotonic() + timeout
        while (state := self.state(job_id)) not in FINAL_STATES:
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} is still {state} after {timeout:g} s")
            time.sleep(0.2)
        return state

    def close(self) -> None:
        """Cancel every job, stop the daemons, kill what is left on the hosts, remove the folder."""
        if self._controller is not None and self._controller.poll() is None:
            try:  # slurmd ends the jobs' processes itself, as on a real cluster
                self.run(["scancel", "--full", "--user=root"], check=False)
                self._wait(lambda: not self.run(["squeue", "--noheader"], check=False).stdout.strip(), 15.0,
                           "jobs still queued")
            except (SlurmError, subprocess.TimeoutExpired):
                pass  # the namespaces' processes are killed below either way
        if self.hosts is not None:
            # SIGKILL for the daemons too: slurmctld takes seconds to save a state nobody will read
            self.hosts.close()  # every process still in the namespaces: daemons and job tasks alike
        for proc in self._daemons:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # not in a namespace any more? then it is ours to kill
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
