"""The data service's operations: a worker joining mid-epoch gets work at once, and the figures and advice of
`data/service/report.py` (what summary.json's data_service block holds)."""

from __future__ import annotations

import importlib
import json
import re
import time

import numpy as np
import pytest
import torch
from svc_pipelines import FILES, PER_FILE, free_port

from conveyor.cluster.variables import DATA_SERVICE_VAR, JOB_SECRET_FILE_VAR
from conveyor.comm.transport import Client
from conveyor.data.service.protocol import DISPATCHER, WORKER
from conveyor.data.service.report import (
    INPUT_BOUND_SHARE,
    dispatcher_report,
    service_report,
    trainer_figures,
    worker_figures,
)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_worker_joining_mid_epoch_gets_work_at_once(roles, record_dir, monkeypatch):
    monkeypatch.setenv("SVC_TEST_DIR", str(record_dir))
    pipelines = importlib.import_module("svc_pipelines")
    roles.serve()
    roles.worker("svc_pipelines:slow_records", "--buffer", "2")
    # little read ahead, so the first worker holds a file or two and the others wait for whoever asks
    remote = pipelines.slow_records().distribute(roles.service, processing_mode="distributed_epoch", buffer=2,
                                                 per_request=1, max_outstanding=1)
    seen, joined_at, first_work = [], None, None
    for batch in remote:
        seen += [int(x) for x in np.asarray(batch).ravel()]
        time.sleep(0.15)  # the trainer is the slow one: the epoch lasts ~5 s
        if joined_at is None and len(seen) >= 6:
            _, log = roles.worker("svc_pipelines:slow_records", "--buffer", "2")
            address = re.search(r"serving on (\S+),", log.read_text()).group(1)
            joined_at = time.monotonic()
        elif joined_at is not None and first_work is None:
            with Client(address, roles.service.secret, name=WORKER, timeout=5.0, sender="test") as client:
                tasks = client.request("stats").header
            if any(t["produced"] > 0 for t in tasks.values()):
                first_work = time.monotonic() - joined_at
    assert sorted(seen) == list(range(FILES * PER_FILE))
    assert first_work is not None and first_work < 3.0  # the trainer looks for new workers every second
    with Client(roles.dispatcher, roles.service.secret, name=DISPATCHER, timeout=5.0, sender="test") as client:
        report = client.request("stats").header["report"]
    assert [w["elements"] > 0 for w in report["workers"]] == [True, True]
    [trainer] = report["trainers"]
    assert trainer["elements"] == FILES * -(-PER_FILE // 2) and trainer["input_wait_share"] < 1


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_chief_trainer_puts_the_dispatchers_figures_in_summary_json_without_a_launcher(roles, tmp_path,
                                                                                          record_dir, monkeypatch):
    """`conveyor k8s` has no launcher to merge the figures: the chief trainer asks the dispatcher at its end."""
    from conveyor.data import Dataset
    from conveyor.train.job import init
    from conveyor.train.trainer import Trainer

    monkeypatch.setenv("SVC_TEST_DIR", str(record_dir))
    pipelines = importlib.import_module("svc_pipelines")
    roles.serve()
    roles.worker()
    ids = [int(x) for b in pipelines.records().distribute(roles.service, processing_mode="distributed_epoch")
           for x in np.asarray(b).ravel()]
    assert sorted(ids) == list(range(FILES * PER_FILE))
    env = {DATA_SERVICE_VAR: roles.dispatcher, JOB_SECRET_FILE_VAR: str(roles.secret_file)}
    block = dispatcher_report(env)
    assert [t["elements"] for t in block["trainers"]] == [FILES * -(-PER_FILE // 4)] and block["advice"]
    assert dispatcher_report({}) is None
    gone = dispatcher_report({**env, DATA_SERVICE_VAR: f"127.0.0.1:{free_port()}"}, timeout=1.0)
    assert list(gone) == ["unavailable"] and "127.0.0.1" in gone["unavailable"]

    for var in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CONVEYOR_STRATEGY"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {**env, "CONVEYOR_OUTPUT_DIR": str(tmp_path / "out")}.items():
        monkeypatch.setenv(var, value)
    job = init()
    model = torch.nn.Linear(4, 2)
    data = Dataset.from_tensor_slices((np.ones((8, 4), np.float32), np.zeros(8, np.int64))).batch(4)
    Trainer(job, *job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1)), torch.nn.functional.cross_entropy,
            data, epochs=1, progress=False).fit()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["data_service"]["trainers"] == block["trainers"] and summary["samples"] == 8


def _worker(wid: int, produced: int, run_s: float, blocked_s: float) -> dict:
    return worker_figures(wid, f"h:{wid}", True, {"1": {"produced": produced, "bytes": produced * 100,
                                                         "run_s": run_s, "blocked_s": blocked_s, "queued": 3,
                                                         "buffer": 16}})


def test_input_bound_trainers_get_the_number_of_workers_the_rates_call_for():
    # two workers make 10 elements/s each, never blocked; the trainer waited half its time, so without waiting
    # it would take 200 elements in 5 s = 40 elements/s: 4 workers, 2 more
    workers = [_worker(1, 100, 10.0, 0.0), _worker(2, 100, 10.0, 0.0)]
    trainers = [trainer_figures("train", {"consumed": 200, "bytes": 20000, "wait_s": 5.0, "elapsed_s": 10.0})]
    block = service_report(workers, trainers, [])
    assert workers[0]["elements_per_s"] == 10.0 and workers[0]["bytes_per_s"] == 1000.0 and workers[0]["queued"] == 3
    assert trainers[0]["input_wait_share"] == 0.5 and trainers[0]["could_consume_per_s"] == 40.0
    assert block["input_bound"] and block["workers_needed"] == 4 and block["more_workers"] == 2
    assert "input-bound" in block["advice"] and "2 more" in block["advice"]


def test_the_epochs_of_one_trainer_count_once_and_two_trainers_add_up():
    workers = [_worker(1, 100, 10.0, 0.0)]
    epoch = {"consumed": 100, "bytes": 0, "wait_s": 5.0, "elapsed_s": 10.0}  # could take 20 elements/s
    one = service_report(workers, [trainer_figures("train-0", epoch), trainer_figures("train-0", epoch)], [])
    assert one["trainer_could_consume_per_s"] == 20.0 and one["workers_needed"] == 2
    two = service_report(workers, [trainer_figures("train-0", epoch), trainer_figures("train-1", epoch)], [])
    assert two["trainer_could_consume_per_s"] == 40.0 and two["workers_needed"] == 4


def test_a_trainer_that_hardly_waits_is_not_input_bound():
    # the workers were blocked most of the time (the trainer took slower than they made)
    workers = [_worker(1, 50, 10.0, 8.0)]
    trainers = [trainer_figures("train", {"consumed": 50, "bytes": 5000, "wait_s": 0.2, "elapsed_s": 10.0})]
    block = service_report(workers, trainers, [])
    assert workers[0]["capacity_elements_per_s"] == 25.0 and workers[0]["blocked_share"] == 0.8
    assert trainers[0]["input_wait_share"] == 0.02 < INPUT_BOUND_SHARE
    assert not block["input_bound"] and block["more_workers"] == 0 and block["workers_needed"] == 1
    assert "not input-bound" in block["advice"]
