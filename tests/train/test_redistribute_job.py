"""A job checkpointed by 2 workers, crashed mid-epoch, resumed by `conveyor run -n 3`: the rest of the epoch is
redistributed and every record id reaches the model exactly once (steps undone by the crash do not count)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.data.records import TFRecordWriter

SCRIPT = Path(__file__).with_name("id_job.py")
FILES, PER_FILE = 4, 12  # 48 ids; 2 workers: 6 steps of 4 each; checkpoint at step 3, crash after step 4

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def conveyor_run(workers: int, data: Path, out: Path, label: str, *args: str, strategy: str = "allreduce",
                 ps: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", str(workers), "--output-dir", str(out),
           "--strategy", strategy, *(["--ps", str(ps)] if ps else []), "--max-restarts", "0", str(SCRIPT), str(data),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200, env={**os.environ, "ID_JOB_RUN": label})


def applied_ids(out: Path, checkpoint_step: int) -> list[int]:
    """Ids of the steps that stayed in the model: the first run's up to its checkpoint, then the second run's."""
    ids = []
    for log in out.glob("ids-*.jsonl"):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if entry["run"] == "second" or entry["step"] <= checkpoint_step:
                ids += entry["ids"]
    return ids


def write_ids(data: Path, sizes: list[int]) -> int:
    """TFRecord files of consecutive ids, one per size; returns how many ids."""
    data.mkdir()
    start = 0
    for f, size in enumerate(sizes):
        with TFRecordWriter(str(data / f"part-{f}.tfrecord")) as w:
            for i in range(start, start + size):
                w.write(str(i).encode())
        start += size
    return start


def test_a_two_worker_checkpoint_resumes_on_three_workers_with_every_id_once(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    write_ids(data, [PER_FILE] * FILES)
    first = conveyor_run(2, data, out, "first", "4")
    assert first.returncode != 0, first.stderr[-3000:]
    second = conveyor_run(3, data, out, "second")
    assert second.returncode == 0, second.stderr[-3000:]
    chief = (out / "logs" / "worker-0.log").read_text()
    assert "resumed step 3, written by 2 workers, on 3 workers: data redistributed" in chief
    assert sorted(p.name for p in out.glob("ids-*.jsonl")) == ["ids-0.jsonl", "ids-1.jsonl", "ids-2.jsonl"]
    counts = collections.Counter(applied_ids(out, checkpoint_step=3))
    assert sorted(counts) == list(range(FILES * PER_FILE)), sorted(set(range(FILES * PER_FILE)) - set(counts))
    assert set(counts.values()) == {1}, [i for i, c in counts.items() if c > 1]


@pytest.mark.parametrize(("strategy", "ps", "said"), [
    ("allreduce", (0, 0), "written by 2 workers, on 3 workers: data redistributed\n"),
    ("fsdp", (0, 0), "written by 2 workers, on 3 workers: data and shards redistributed\n"),
    ("ps-sync", (2, 1), "written by 2 workers with 2 ps tasks, on 3 workers with 1: data and shards redistributed ("),
], ids=["allreduce", "fsdp", "ps-sync"])
def test_a_leftover_dealt_in_unequal_numbers_of_batches_still_reaches_the_model_exactly_once(tmp_path, strategy, ps,
                                                                                              said):
    """50 ids (26 and 24 per old worker), 26 left after step 3: the new workers get unequal numbers of batches;
    the ones that run out take zero-weight steps until the last worker's batches are used (none dropped).
    Under fsdp (and ps-sync, 2 ps tasks -> 1) the model's shards are re-split too, said in the same line."""
    data, out = tmp_path / "data", tmp_path / "out"
    total = write_ids(data, [13, 12, 13, 12])
    assert conveyor_run(2, data, out, "first", "4", strategy=strategy, ps=ps[0]).returncode != 0
    second = conveyor_run(3, data, out, "second", strategy=strategy, ps=ps[1])
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed step 3, {said}" in (out / "logs" / "worker-0.log").read_text()
    counts = collections.Counter(applied_ids(out, checkpoint_step=3))
    assert sorted(counts) == list(range(total)), sorted(set(range(total)) - set(counts))
    assert set(counts.values()) == {1}, [i for i, c in counts.items() if c > 1]
    batches = [sum(json.loads(line)["run"] == "second" for line in (out / f"ids-{r}.jsonl").read_text().splitlines())
               for r in range(3)]
    assert len(set(batches)) > 1, batches  # the deal was uneven in batches
