"""The Slurm test cluster: nodes on their own addresses, and nothing left behind, also when a test fails."""

from __future__ import annotations

import time

import psutil
import pytest

from conveyor.testing.hosts import _namespaces
from conveyor.testing.slurm import SlurmCluster, unavailable

pytestmark = [pytest.mark.multiprocess]


def processes_of(folder: str) -> list[psutil.Process]:
    """Processes whose command line or SLURM_CONF names the cluster's folder: daemons and job steps."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if folder in " ".join(proc.info["cmdline"] or ()) or folder in proc.environ().get("SLURM_CONF", ""):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_a_failing_test_leaves_no_daemon_job_namespace_or_file(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match="the test failed"), SlurmCluster(2) as cluster:
        folder, tag = str(cluster.folder), cluster.hosts.tag
        script = cluster.folder / "job.sh"
        script.write_text("#!/bin/bash\nsrun --ntasks-per-node=1 bash -c 'hostname -I > /dev/null; sleep 300'\n")
        job = cluster.sbatch(script, "--nodes=2", f"--output={tmp_path}/out")
        deadline = time.monotonic() + 60
        while cluster.state(job) != "RUNNING" or len([p for p in processes_of(folder) if "sleep" in p.cmdline()]) < 2:
            assert time.monotonic() < deadline, cluster.state(job)
            time.sleep(0.1)
        hosts = cluster.run(["srun", "--nodes=2", "--ntasks-per-node=1", "--overlap", f"--jobid={job}", "sh", "-c",
                             "echo $(hostname) $(hostname -I)"]).stdout.split("\n")
        assert sorted(line.strip() for line in hosts if line.strip()) == ["host0 10.77.0.1", "host1 10.77.0.2"]
        raise RuntimeError("the test failed")
    assert not processes_of(folder)
    assert not [ns for ns in _namespaces() if ns.startswith(tag)]
    assert not cluster.folder.exists()
