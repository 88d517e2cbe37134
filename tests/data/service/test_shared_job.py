"""Several trainers sharing one distributed_epoch job: together they consume every record once (issue 23).

The dispatcher's split ownership without sockets (jobs.py), then real `conveyor data serve` / `worker`
processes on 127.0.0.1 with two trainer iterators of one `job_name` in threads of this process.
"""

from __future__ import annotations

import importlib
import json
import threading
from collections import Counter

import numpy as np
import pytest
from svc_pipelines import FILES, PER_FILE

from conveyor.data.service import DataServiceError
from conveyor.data.service.jobs import Job

FILES_XY = ["a", "b", "c", "d"]


def test_a_split_given_back_goes_only_to_the_trainer_that_owns_it():
    job = Job(1, "j", "distributed_epoch", FILES_XY)
    assert job.take(1, "A") == {"split": 0, "file": "a"}
    assert job.take(2, "B") == {"split": 1, "file": "b"}
    assert job.take(2, "A") == {"split": 2, "file": "c"}
    assert job.give_back({1}) == {1: [0]}  # worker 1 died holding A's split 0
    assert job.take(2, "B") == {"split": 3, "file": "d"}  # B gets a fresh one, never A's
    assert job.take(2, "B") == {"split": None, "wait": True}  # B's splits 1, 3 are out: a worker may still die
    assert job.take(2, "A") == {"split": 0, "file": "a"}  # the owner takes its split back
    for split in (1, 3):
        job.acknowledge(split)
    assert job.take(2, "B") == {"split": None}  # B ends: it holds nothing another trainer would need
    assert job.take(3, "A") == {"split": None, "wait": True}
    job.give_back({2}, trainer="B")  # a worker releasing B's task gives back only B's splits: none left
    assert not job.returned.get("A") and job.handed == {0: 2, 2: 2}
    for split in (0, 2):
        job.acknowledge(split)
    assert job.take(3, "A") == {"split": None}
    assert job.stats()["done"] == 4 and job.trainer_count() == 2


def test_resumed_trainers_join_one_job_which_waits_for_all_of_them():
    job = Job(2, "j", "distributed_epoch", FILES_XY)
    job.join({"token": "A", "trainers": 2, "acknowledged": [0], "begun": [2]})
    assert job.take(1, "A") == {"split": None, "wait": True}  # B, which may have consumed split 1, has not joined
    assert job.accepts({"token": "B"}) and not job.accepts({"token": "A"})
    job.join({"token": "B", "trainers": 2, "acknowledged": [1], "begun": []})
    assert not job.accepts({"token": "C"})
    assert job.take(1, "B") == {"split": 3, "file": "d"}  # split 2 was begun by A: B never gets it
    assert job.take(1, "B") == {"split": None, "wait": True}
    assert job.take(1, "A") == {"split": 2, "file": "c"}
    with pytest.raises(DataServiceError, match="cannot resume job j"):
        job.join({"token": "C", "acknowledged": [9], "begun": []})


@pytest.fixture
def pipelines(monkeypatch, record_dir):
    monkeypatch.setenv("SVC_TEST_DIR", str(record_dir))
    return importlib.import_module("svc_pipelines")


def _ids(batches) -> list[int]:
    return [int(x) for batch in batches for x in np.asarray(batch).ravel()]


def _two_trainers(iterators, consume) -> list[list]:
    """Run ``consume(it)`` for each iterator in a thread of its own; what each returned, raising the first error."""
    results: list = [None] * len(iterators)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = consume(iterators[k])
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(iterators))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a trainer did not finish"
    return results


OPTIONS = {"processing_mode": "distributed_epoch", "job_name": "shared", "per_request": 1, "max_outstanding": 1}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_trainers_sharing_a_job_consume_every_record_once(roles, pipelines):
    roles.serve()
    roles.worker("svc_pipelines:slow_records")
    roles.worker("svc_pipelines:slow_records")
    its = [iter(pipelines.slow_records().distribute(roles.service, **OPTIONS)) for _ in range(2)]
    got = _two_trainers(its, list)
    assert Counter(_ids(got[0] + got[1])) == Counter(range(FILES * PER_FILE))
    assert got[0] and got[1]  # both trainers took part


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_trainers_sharing_a_job_survive_a_killed_worker(roles, pipelines):
    roles.serve("--worker-timeout", "2")
    victim, _ = roles.worker("svc_pipelines:slow_records")
    roles.worker("svc_pipelines:slow_records")
    its = [iter(pipelines.slow_records().distribute(roles.service, worker_timeout=3.0, **OPTIONS))
           for _ in range(2)]
    started = threading.Barrier(3, timeout=60)

    def consume(it) -> list:
        first = [next(it) for _ in range(3)]
        started.wait()
        return first + list(it)

    killer = threading.Thread(target=lambda: (started.wait(), victim.kill()), daemon=True)
    killer.start()
    got = _two_trainers(its, consume)
    killer.join(timeout=10)
    assert victim.poll() is not None
    assert Counter(_ids(got[0] + got[1])) == Counter(range(FILES * PER_FILE))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_trainers_resumed_from_their_checkpoints_continue_the_shared_epoch(roles, pipelines):
    """Each trainer saves its position; what both took after saving is lost with them; both resume (new
    iterators, new root seeds) and together finish the epoch: every record once in what the model saw."""
    roles.serve()
    roles.worker("svc_pipelines:shuffled_records")
    roles.worker("svc_pipelines:shuffled_records")
    its = [iter(pipelines.shuffled_records().distribute(roles.service, **OPTIONS)) for _ in range(2)]
    saved = threading.Barrier(2, timeout=60)

    def before_crash(it) -> tuple[list, dict, list]:
        before = [next(it) for _ in range(4)]
        saved.wait()  # both have joined the job before either saves (a checkpoint is taken mid-epoch)
        state = json.loads(json.dumps(it.state_dict()))
        lost = [next(it) for _ in range(2)]
        it.close()
        return before, state, lost

    first = _two_trainers(its, before_crash)
    assert all(len(lost) == 2 for _, _, lost in first)
    resumed = []
    for _, state, _ in first:
        it = iter(pipelines.shuffled_records().distribute(roles.service, **OPTIONS))
        it.load_state_dict(state)
        resumed.append(it)
    after = _two_trainers(resumed, list)
    seen = _ids(first[0][0] + first[1][0] + after[0] + after[1])
    assert Counter(seen) == Counter(range(FILES * PER_FILE))
