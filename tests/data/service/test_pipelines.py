"""The data service's pieces in one process: pipelines by name, fingerprint differences, splits, secrets,
element frames and the dispatcher's job bookkeeping."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from svc_pipelines import FILES, free_port

from conveyor.cli.main import main
from conveyor.comm.transport import Deferred
from conveyor.data import Dataset, TFRecordDataset
from conveyor.data.service import DataServiceError, PipelineMismatchError, Service
from conveyor.data.service.dispatcher import Dispatcher
from conveyor.data.service.pipelines import fingerprint, first_difference, load_pipeline, with_split_source
from conveyor.data.service.protocol import check_mode, element_frames, elements_from_frames, resolve_service
from conveyor.data.service.splits import split_files
from conveyor.data.service.worker import DataWorker, _Task


def test_first_difference_names_the_op_and_argument():
    a = fingerprint(Dataset.range(10).map(abs).batch(4))
    b = fingerprint(Dataset.range(10).map(abs).batch(8))
    assert first_difference(a, b) == "op batch (pipeline > batch): argument batch_size is 4 here, 8 there"
    c = fingerprint(Dataset.range(10).batch(4))
    assert "op 'map' here, 'range' there" in first_difference(a, c)


@pytest.mark.parametrize(("spec", "match"), [
    ("svc_pipelines", "expected MODULE:FUNCTION"),
    ("no_such_module_here:f", "cannot import no_such_module_here"),
    ("svc_pipelines:missing", "has no function 'missing'"),
    ("svc_pipelines:free_port", "returned int, not a conveyor.data.Dataset"),
])
def test_a_pipeline_that_cannot_be_built_by_name_is_refused(spec, match):
    with pytest.raises(PipelineMismatchError, match=match):
        load_pipeline(spec)


def test_split_source_reads_only_the_files_handed_out(record_dir):
    files = sorted(str(p) for p in record_dir.glob("part-*.tfrecord"))
    ds = TFRecordDataset(files).batch(5)
    assert split_files(ds._node) == files
    handed = iter([files[2], files[0]])
    local = with_split_source(ds, lambda: next(handed, None))
    got = [r.decode() for batch in local for r in np.asarray(batch).ravel()]
    assert got == [f"id-{i}" for i in [*range(20, 30), *range(0, 10)]]


def test_distributed_epoch_needs_one_file_list():
    assert split_files(Dataset.range(4)._node) is None
    with pytest.raises(DataServiceError, match="exactly one"):
        with_split_source(Dataset.range(4), lambda: None)


def test_service_address_needs_the_secret(monkeypatch):
    monkeypatch.delenv("CONVEYOR_JOB_SECRET_FILE", raising=False)
    monkeypatch.delenv("CONVEYOR_JOB_SECRET", raising=False)
    with pytest.raises(DataServiceError, match="CONVEYOR_JOB_SECRET_FILE"):
        resolve_service("127.0.0.1:5050")
    monkeypatch.setenv("CONVEYOR_JOB_SECRET", "ab" * 32)
    assert resolve_service("127.0.0.1:5050") == Service("127.0.0.1:5050", b"\xab" * 32)
    with pytest.raises(DataServiceError, match="processing_mode must be one of"):
        check_mode("one_epoch")


def test_elements_travel_as_packed_frames():
    elements = [(np.arange(6, dtype=np.float32).reshape(2, 3), b"raw", {"label": 3}), "text"]
    frames, counts = element_frames(elements)
    back = [e for e, _ in elements_from_frames(frames, counts)]
    assert back[1] == "text" and back[0][1] == b"raw" and back[0][2] == {"label": 3}
    np.testing.assert_array_equal(back[0][0], elements[0][0])


def test_elements_travel_without_copies_and_arrive_aligned():
    """Neither the worker nor the trainer copies a batch: the frames view the element's array, the received
    array views its frame; an array its frame leaves misaligned is copied."""
    batch = np.arange(4096, dtype=np.float64)
    frames, counts = element_frames([(batch, 7)])
    assert counts == [2] and np.shares_memory(frames[1], batch)
    (back, label), nbytes = elements_from_frames(frames, counts)[0]
    assert np.shares_memory(back, frames[1]) and label == 7 and nbytes == sum(f.nbytes for f in frames)
    np.testing.assert_array_equal(back, batch)
    odd = np.empty(batch.nbytes + 1, dtype=np.uint8)[1:]  # the same bytes at an odd address
    odd[:] = frames[1]
    (moved, _), _ = elements_from_frames([frames[0], odd], counts)[0]
    assert not np.shares_memory(moved, odd) and moved.ctypes.data % moved.dtype.alignment == 0
    np.testing.assert_array_equal(moved, batch)
    with pytest.raises(DataServiceError, match="another conveyor version"):
        elements_from_frames(frames, [1])


def test_dispatcher_hands_each_split_once_and_gives_a_silent_workers_back():
    d = Dispatcher(f"127.0.0.1:{free_port()}", b"k" * 32, worker_timeout=60.0)
    try:
        fp = fingerprint(Dataset.range(3))
        w1 = d._register({"address": "a:1", "pipeline": "m:f", "fingerprint": fp, "files": ["x", "y"]})["worker_id"]
        w2 = d._register({"address": "b:1", "pipeline": "m:f", "fingerprint": fp, "files": ["x", "y"]})["worker_id"]
        job = d._job({"mode": "distributed_epoch", "job_name": "j", "fingerprint": fp, "files": ["x", "y"]})["job_id"]
        assert d._get_split({"worker_id": w1, "job_id": job}) == {"split": 0, "file": "x"}
        assert d._get_split({"worker_id": w2, "job_id": job}) == {"split": 1, "file": "y"}
        assert d._get_split({"worker_id": w2, "job_id": job}) == {"split": None, "wait": True}
        d._split_done({"job_id": job, "split": 1})
        d.workers[w1].last_seen -= 120  # w1 went silent holding split 0
        assert d._get_split({"worker_id": w2, "job_id": job}) == {"split": 0, "file": "x"}
        d._release({"worker_id": w2, "job_id": job})  # w2 stopped its task holding split 0
        assert d._get_split({"worker_id": w2, "job_id": job}) == {"split": 0, "file": "x"}
        d._split_done({"job_id": job, "split": 0})
        assert d._get_split({"worker_id": w2, "job_id": job}) == {"split": None}
        stats = d._stats({})
        assert stats["jobs"][str(job)] == {"name": "j", "mode": "distributed_epoch", "splits": 2, "done": 2,
                                           "in_progress": 0, "waiting": 0}
        assert [(w["address"], w["alive"]) for w in stats["workers"]] == [("a:1", False), ("b:1", True)]
        with pytest.raises(DataServiceError, match="cannot resume job j"):
            d._job({"mode": "distributed_epoch", "job_name": "j", "fingerprint": fp, "files": ["x", "y"],
                    "resume": [5]})
        with pytest.raises(PipelineMismatchError, match="argument stop is 4 here, 3 there"):
            d._register({"address": "c:1", "pipeline": "m:g", "fingerprint": fingerprint(Dataset.range(4)),
                         "files": None})
    finally:
        d.close()


def test_commands_refuse_a_missing_or_open_secret(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CONVEYOR_JOB_SECRET_FILE", raising=False)
    assert main(["data", "serve", "--port", str(free_port())]) != 0
    assert "give --secret-file FILE" in capsys.readouterr().err
    secret = tmp_path / "job.secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o644)
    assert main(["data", "worker", "--dispatcher", "127.0.0.1:1", "--port", str(free_port()), "--pipeline",
                 "svc_pipelines:records", "--secret-file", str(secret)]) != 0
    assert "readable by other users" in capsys.readouterr().err


def test_a_worker_stops_an_abandoned_task_and_gives_its_splits_back(record_dir, monkeypatch):
    monkeypatch.setenv("SVC_TEST_DIR", str(record_dir))
    secret = b"s" * 32
    dispatcher = Dispatcher(f"127.0.0.1:{free_port()}", secret).start()
    worker = DataWorker(dispatcher.server.address, "svc_pipelines:records", secret, bind=f"127.0.0.1:{free_port()}",
                        buffer=1, idle_timeout=0.5).start()
    try:
        it = iter(load_pipeline("svc_pipelines:records").distribute(
            Service(dispatcher.server.address, secret), processing_mode="distributed_epoch", per_request=1,
            max_outstanding=1, buffer=1))
        next(it)
        it.close()  # the trainer goes away mid-epoch
        (job,) = dispatcher.jobs.values()
        deadline = time.monotonic() + 20
        while (worker.tasks or job.handed) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not worker.tasks and not job.handed and job.stats()["waiting"] == FILES - len(job.done)
    finally:
        worker.close()
        dispatcher.close()


def test_status_command_prints_the_dispatchers_workers_and_jobs(tmp_path, capsys):
    secret_file = tmp_path / "job.secret"
    secret_file.write_text("cd" * 32)
    secret_file.chmod(0o600)
    dispatcher = Dispatcher(f"127.0.0.1:{free_port()}", b"\xcd" * 32).start()
    try:
        assert main(["data", "status", "--dispatcher", dispatcher.server.address, "--secret-file",
                     str(secret_file)]) == 0
        status = json.loads(capsys.readouterr().out)
        assert {k: status[k] for k in ("workers", "jobs")} == {"workers": [], "jobs": {}}
        assert status["report"]["advice"] == "no trainer reported yet" and status["report"]["workers"] == []
    finally:
        dispatcher.close()


def test_a_worker_answers_a_tasks_requests_in_the_order_they_came():
    """A later request must not take elements while an earlier one waits: the trainer reads replies in
    request order, so the split's elements would arrive out of order (and a skipped one be lost)."""
    worker = DataWorker("127.0.0.1:1", "svc_pipelines:endless", b"s" * 32, bind=f"127.0.0.1:{free_port()}")
    try:
        release = threading.Event()

        def items():
            release.wait(10)
            yield from ((0, k, k) for k in range(4))

        task = worker.tasks[(7, None)] = _Task(items(), 8, threading.Event())
        request = SimpleNamespace(kind="get_elements", header={"job_id": 7, "mode": "distributed_epoch", "max": 2})
        first = worker._handle(request)
        assert isinstance(first, Deferred)  # nothing produced yet: it waits
        release.set()
        deadline = time.monotonic() + 10
        while task.queue.qsize() < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(worker._handle(request), Deferred)  # elements are ready, but the first request is owed them
        task.stop()
    finally:
        worker.close()
