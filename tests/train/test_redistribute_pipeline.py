"""Pipeline replicas change, data side: a checkpoint of 2 stages x 2 replicas resumed on 2 x 1, then on 2 x 2
again, every record id reaching the model exactly once over the epoch (steps undone by the crashes do not count).

The stages of a replica read the replica's shard (`job.data_shard`), so the rest of the epoch is dealt by replica:
each new replica's stages run the same share. Only the first stage's ids are counted (the others log the same).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.test_redistribute_job import SCRIPT, write_ids

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(480)]

STAGES = 2


def pipeline_run(processes: int, data: Path, out: Path, label: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", str(processes), "--output-dir", str(out),
           "--strategy", "pipeline", "--stages", str(STAGES), "--microbatches", "1", "--schedule", "gpipe",
           "--max-restarts", "0",
           str(SCRIPT), str(data), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200, env={**os.environ, "ID_JOB_RUN": label})


def first_stage_steps(out: Path) -> list[dict]:
    """Every step the first stages logged (ranks 0, 2, ...: stage rank % STAGES), with its rank."""
    steps = []
    for log in out.glob("ids-*.jsonl"):
        rank = int(log.stem.split("-")[1])
        if rank % STAGES == 0:
            steps += [{**json.loads(line), "rank": rank} for line in log.read_text().splitlines()]
    return steps


def test_pipeline_replicas_change_twice_in_an_epoch_and_every_id_reaches_the_model_once(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    total = write_ids(data, [14, 13, 13, 13])  # replicas of 27 and 26 ids
    assert pipeline_run(4, data, out, "first", "4").returncode != 0  # checkpoint at step 3, crash after 4
    second = pipeline_run(2, data, out, "second", "7")  # 1 replica: 29 ids left; checkpoint at 6, crash after 7
    assert second.returncode != 0, second.stderr[-3000:]
    said = (out / "logs" / "worker-0.log").read_text()
    assert "resumed step 3, written by 4 workers, on 2 workers: data redistributed" in said
    third = pipeline_run(4, data, out, "third")  # 2 replicas again, over the 17 the one left at step 6: 9 and 8
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resumed step 6, written by 2 workers, on 4 workers: data redistributed" in (
        out / "logs" / "worker-0.log").read_text()
    kept = {"first": 3, "second": 6, "third": None}  # a run's steps after its last checkpoint were undone
    steps = [s for s in first_stage_steps(out) if kept[s["run"]] is None or s["step"] <= kept[s["run"]]]
    counts = collections.Counter(i for s in steps for i in s["ids"])
    assert sorted(counts) == list(range(total)), sorted(set(range(total)) - set(counts))
    assert set(counts.values()) == {1}, [i for i, c in counts.items() if c > 1]
    # the stages of a replica trained on the same batches: stage 1 logged what stage 0 did, step by step
    for rank in (0, 2):
        mine = [(s["run"], s["step"], s["ids"]) for s in steps if s["rank"] == rank]
        theirs = [(e["run"], e["step"], e["ids"]) for e in map(json.loads, (out / f"ids-{rank + 1}.jsonl")
                                                                 .read_text().splitlines())]
        assert mine == [t for t in theirs if kept[t[0]] is None or t[1] <= kept[t[0]]]
    # 3 batches and 2: the replica that ran out took a zero-weight step (no callback) rather than end the epoch
    assert sorted(sum(s["run"] == "third" for s in steps if s["rank"] == rank) for rank in (0, 2)) == [2, 3]
