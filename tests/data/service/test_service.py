"""The data service with real processes on 127.0.0.1: a `conveyor data serve` dispatcher, `conveyor data worker`s,
and this process as the trainer (`Dataset.distribute`)."""

from __future__ import annotations

import importlib
import json
import time
from collections import Counter

import numpy as np
import pytest
from svc_pipelines import FILES, PER_FILE, free_port

from conveyor.comm.transport import Client
from conveyor.data.service import DataServiceError, PipelineMismatchError, Service
from conveyor.data.service.protocol import WORKER

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


@pytest.fixture
def pipelines(monkeypatch, record_dir):
    monkeypatch.setenv("SVC_TEST_DIR", str(record_dir))
    return importlib.import_module("svc_pipelines")


def ids(dataset) -> list[int]:
    return sorted(int(x) for batch in dataset for x in np.asarray(batch).ravel())


def test_distributed_epoch_yields_every_record_once(roles, pipelines):
    roles.serve()
    roles.worker()
    roles.worker()
    local = ids(pipelines.records())
    assert local == list(range(FILES * PER_FILE))
    remote = pipelines.records().distribute(roles.service, processing_mode="distributed_epoch", job_name="train")
    assert ids(remote) == local
    assert ids(remote) == local  # the next epoch: a new iteration of the named job


def test_parallel_epochs_yields_each_record_once_per_worker(roles, pipelines):
    roles.serve()
    roles.worker()
    roles.worker()
    remote = pipelines.records().distribute(roles.service, processing_mode="parallel_epochs")
    counts = Counter(ids(remote))
    assert counts == Counter({i: 2 for i in range(FILES * PER_FILE)})


def test_worker_with_another_pipeline_is_refused(roles):
    roles.serve()
    roles.worker()
    proc, log = roles.worker("svc_pipelines:records_batch8", ready=False)
    assert proc.wait(timeout=60) != 0
    text = log.read_text()
    assert "different pipeline" in text and "batch_size is 8 here, 4 there" in text
    assert "svc_pipelines:records_batch8" in text and "svc_pipelines:records)" in text


def test_trainer_with_another_pipeline_is_refused(roles, pipelines):
    roles.serve()
    roles.worker()
    remote = pipelines.records_batch8().distribute(roles.service, processing_mode="distributed_epoch")
    with pytest.raises(PipelineMismatchError, match="batch_size is 8 here, 4 there"):
        next(iter(remote))


def test_peer_without_the_secret_is_refused(roles, pipelines):
    roles.serve()
    wrong = Service(roles.dispatcher, b"\x01" * 32)
    remote = pipelines.records().distribute(wrong, processing_mode="parallel_epochs", timeout=3.0)
    with pytest.raises(DataServiceError, match="secret"):
        next(iter(remote))


def test_unreachable_dispatcher_names_the_fix(pipelines, secret_file):
    service = Service(f"127.0.0.1:{free_port()}", bytes.fromhex(secret_file.read_text()))
    remote = pipelines.records().distribute(service, processing_mode="parallel_epochs", timeout=2.0)
    with pytest.raises(DataServiceError, match="conveyor data serve"):
        next(iter(remote))


def test_slow_consumer_bounds_what_the_worker_produces(roles, pipelines):
    """Credit + bounded queues: however fast the worker, it produces at most its buffer, the requests in
    flight and the trainer's buffer ahead of what the trainer took."""
    roles.serve()
    _, log = roles.worker("svc_pipelines:endless", "--buffer", "4")
    address = log.read_text().split("serving on ")[1].split(",")[0]
    remote = pipelines.endless().distribute(roles.service, max_outstanding=1, per_request=2, buffer=2)
    it = iter(remote)
    taken = [next(it) for _ in range(3)]
    time.sleep(2.0)  # the producer has had time to run far ahead, were it not bounded
    with Client(address, roles.service.secret, name=WORKER, timeout=10.0) as client:
        (stats,) = client.request("stats").header.values()
    it.close()
    assert len(taken) == 3
    # 3 taken + 2 in the trainer's queue + 1 request of 2 in flight + 4 queued + 1 blocked in put
    assert stats["queued"] <= 4
    assert stats["produced"] <= 3 + 2 + 2 + 4 + 1 + 2


def test_worker_killed_mid_epoch_loses_and_repeats_nothing(roles, pipelines):
    """distributed_epoch, exactly once: the killed worker's unacknowledged splits go to the other worker,
    which reads them again; the trainer drops what it already returned."""
    roles.serve("--worker-timeout", "2")
    victim, _ = roles.worker("svc_pipelines:slow_records")
    roles.worker("svc_pipelines:slow_records")
    remote = pipelines.slow_records().distribute(roles.service, processing_mode="distributed_epoch",
                                                 worker_timeout=3.0, per_request=1, max_outstanding=1)
    it = iter(remote)
    first = [next(it) for _ in range(4)]
    victim.kill()
    rest = list(it)
    got = sorted(int(x) for batch in first + rest for x in np.asarray(batch).ravel())
    assert got == list(range(FILES * PER_FILE))
    assert "go to other workers" in roles.log_of(0)


def test_resumed_trainer_continues_the_epoch_where_its_checkpoint_was(roles, pipelines):
    """The iterator's state is the service position: elements taken after the checkpoint (lost with the
    crashed trainer) come again, the ones before it never do; a file read again is shuffled alike."""
    roles.serve()
    roles.worker("svc_pipelines:shuffled_records")
    roles.worker("svc_pipelines:shuffled_records")
    options = {"processing_mode": "distributed_epoch", "job_name": "train", "per_request": 1}
    it = iter(pipelines.shuffled_records().distribute(roles.service, **options))
    before = [next(it) for _ in range(5)]
    state = json.loads(json.dumps(it.state_dict()))
    lost = [next(it) for _ in range(3)]
    it.close()
    resumed = iter(pipelines.shuffled_records().distribute(roles.service, **options))  # another root seed
    resumed.load_state_dict(state)
    after = list(resumed)
    assert len(lost) == 3
    got = sorted(int(x) for batch in before + after for x in np.asarray(batch).ravel())
    assert got == list(range(FILES * PER_FILE))


def test_parallel_epochs_position_cannot_be_saved(roles, pipelines):
    roles.serve()
    roles.worker()
    it = iter(pipelines.records().distribute(roles.service))
    next(it)
    with pytest.raises(DataServiceError, match="distributed_epoch"):
        it.state_dict()
    it.close()


def test_a_worker_joining_mid_epoch_gets_work(roles, pipelines):
    roles.serve()
    roles.worker("svc_pipelines:slow_records", "--buffer", "1")
    it = iter(pipelines.slow_records().distribute(roles.service, processing_mode="distributed_epoch",
                                                  per_request=1, max_outstanding=1, buffer=1, refresh=0.2))
    got = [next(it) for _ in range(2)]
    _, log = roles.worker("svc_pipelines:slow_records")
    address = log.read_text().split("serving on ")[1].split(",")[0]
    for batch in it:
        got.append(batch)
        time.sleep(0.1)  # a slow trainer: the first worker alone would not be done before the second joined
    with Client(address, roles.service.secret, name=WORKER, timeout=10.0) as client:
        (stats,) = client.request("stats").header.values()
    assert stats["produced"] > 0
    assert sorted(int(x) for batch in got for x in np.asarray(batch).ravel()) == list(range(FILES * PER_FILE))
