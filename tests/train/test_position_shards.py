"""Data positions dealt by shard: the processes that read one shard (a pipeline replica's stages) count once when
the rest of an epoch is redistributed, and positions that do not say which shard they read are refused for a job
whose processes share shards."""

from __future__ import annotations

import pytest

from conveyor.data.redistribute import leftover_iterator
from conveyor.train.checkpoint import CheckpointManager, ResumeError
from conveyor.train.position import DataPosition
from train.test_trainer import BATCH, N, sharded


def never(docs) -> bool:
    return False


def pipeline_checkpoint(tmp_path, replicas: int, stages: int, named: bool = True, lag: int = 0):
    """A checkpoint of `stages` x `replicas` processes after one batch each (stage s of replica j is rank
    j * stages + s and reads shard j; with `lag` the last process is that many batches behind); the ids taken."""
    taken, docs = [], {}
    for j in range(replicas):
        it = sharded(replicas, j).iterator(root_seed=5, iteration=0)
        taken += [round(float(v) * N) for v in next(it)[0][:, 0]]
        for s in range(stages):
            docs[f"data/worker-{j * stages + s}"] = {
                "format": "conveyor.trainer.data", "version": 1, "epoch": 0, "batches": 1, "root_seed": 5,
                "iterator": it.state_dict(), "rng": None, **({"shard": [replicas, j]} if named else {})}
        it.close()
    docs[f"data/worker-{replicas * stages - 1}"]["batches"] -= lag
    manager = CheckpointManager(tmp_path / "checkpoints", fsync=False)
    manager.save(1, {}, extra={"epoch": 0, "world_size": replicas * stages}, docs=docs)
    return manager.load(1), taken


@pytest.mark.parametrize("replicas", [1, 3])
def test_two_replicas_of_two_stages_resume_on_other_replicas_with_every_sample_once(tmp_path, replicas):
    ckpt, taken = pipeline_checkpoint(tmp_path, replicas=2, stages=2)
    rest = []
    for j in range(replicas):
        stages = [DataPosition.for_rank(ckpt, j * 2 + s, replicas * 2, never, sharded(replicas, j), (replicas, j))
                  for s in range(2)]
        assert stages[0].leftover == stages[1].leftover and stages[0].shard == [replicas, j]  # one share per replica
        it = leftover_iterator(sharded(replicas, j), stages[0].leftover, root_seed=5, iteration=0)
        rest += [round(float(v) * N) for batch in it for v in batch[0][:, 0]]
        it.close()
    assert sorted(taken + rest) == list(range(N))
    assert len(taken) == 2 * BATCH  # each replica's batch counted once, not once per stage


def test_positions_that_do_not_name_their_shard_are_refused_for_processes_that_share_one(tmp_path):
    ckpt, _ = pipeline_checkpoint(tmp_path, replicas=2, stages=2, named=False)
    with pytest.raises(ResumeError, match=r"do not say which of its 4 processes read which shard.*-n 4.*--no-resume"):
        DataPosition.for_rank(ckpt, 0, 2, never, sharded(1, 0), (1, 0))


def test_the_stages_of_a_replica_at_different_batches_are_refused(tmp_path):
    ckpt, _ = pipeline_checkpoint(tmp_path, replicas=2, stages=2, lag=1)
    with pytest.raises(ResumeError, match=r"read shard 1 of the data were at different batches \(\[0, 1\]\)"):
        DataPosition.for_rank(ckpt, 0, 2, never, sharded(1, 0), (1, 0))
