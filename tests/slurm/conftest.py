"""The Slurm test cluster: started once per module, stopped and removed whatever the tests did."""

from __future__ import annotations

import pytest

from conveyor.testing.slurm import SlurmCluster, SlurmError, unavailable


@pytest.fixture(scope="module")
def slurm_cluster():
    """Two Slurm nodes, host0 and host1, each a namespace host (conveyor.testing.slurm), both in partition main
    (the default), host1 alone in partition train and host0 alone in data (for heterogeneous jobs: the training
    component on the node whose name sorts last, as gpu* after cpu*); skips where Slurm cannot run here (not root,
    no network namespaces, the packages missing and not installable)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    try:
        cluster = SlurmCluster(2, partitions={"train": [1], "data": [0]})
    except SlurmError as e:
        pytest.skip(f"Slurm did not start here: {e}")
    with cluster:
        yield cluster
