"""benchmarks/elastic_goodput.py: how goodput is counted (pure), and a short run of the section on namespace hosts.

The short run (--quick: 90 s per run, one worker host killed at 45 s and back 20 s later) is the test of the
10-minute benchmark: the job never stops (every launcher that ends by itself exits 0, no gap past --period), the
failure is seen (the world shrinks, then grows back), its stall is split into parts and goodput is counted; its
value is not asserted (a short run on a shared machine). Both runs train more epochs than the window holds and
the benchmark ends them after it, so a quieter machine cannot end the failure run before its kill (it once did,
when that run trained the peer's epochs x 0.8: no record after the kill, KeyError 'workers_after').
It needs root (network namespaces) and skips without; the hosts are removed on every exit path.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from conveyor.testing import hosts as hosts_module

BENCHMARK = "elastic"


def record(step: int, t: float, samples: int = 64, workers: int = 2, epoch: int = 0) -> dict:
    return {"event": "train", "step": step, "time": t, "samples": samples, "workers": workers, "epoch": epoch}


@pytest.fixture(scope="module")
def goodput(bench):
    return bench.elastic_goodput  # the section's module, as elastic.py imported it


def test_records_past_the_step_resumed_from_are_undone(goodput):
    records = [record(5, 1), record(10, 2), record(15, 3), record(20, 4),  # dies after 20; checkpoint at 10
               {"event": "eval", "step": 20, "time": 4.5},
               record(15, 9, 48, 3), record(20, 10, 48, 3),  # resumed from 10 on 3 workers
               record(25, 11, 48, 3)]  # resumed from 20 (a regroup at a checkpoint): nothing undone
    kept = goodput.kept_records(records)
    assert [(r["step"], r["time"]) for r in kept] == [(5, 1), (10, 2), (15, 9), (20, 10), (25, 11)]
    assert [r["undone"] for r in kept] == [0, 0, 2, 0, 0]
    run = goodput.summarize_run(records, t0=1.0, duration=9.5)
    assert run["samples_kept"] == 64 + 48 + 48  # steps 10, 15, 20: after the first record, within 9.5 s of it
    assert run["undone_samples"] == 128 and run["max_gap_s"] == 7
    assert run["outlasted_window"] and math.isclose(run["rate"], 160 / 9.5)  # over the window: the run outlasted it
    short = goodput.summarize_run(records, t0=1.0, duration=20)  # a run that stopped inside its window:
    assert not short["outlasted_window"] and math.isclose(short["rate"], (64 + 3 * 48) / 10)  # to its last record
    assert goodput.world_timeline(kept, 1.0) == [[0, 2], [8, 3]]


def test_a_failure_row_has_the_stall_the_steps_undone_and_the_rejoin(goodput):
    kept = goodput.kept_records([record(5, 1), record(10, 2), record(15, 3), record(20, 3.4),  # resumed from 10:
                                 record(15, 8, workers=1), record(20, 9, workers=1), record(25, 20), record(30, 21)])
    events = [{"host": "host1", "killed": 3.5, "killed_rel": 2.5, "back": 12, "back_rel": 11, "t0": 1.0}]
    (row,) = goodput.failure_rows(kept, events, pace=1.0)
    assert row["stall_s"] == 8 - 2 - 1 and row["undone_steps"] == 10 and row["workers_after"] == 1
    assert row["rejoin_stall_s"] == 20 - 9 - 1 and row["rejoined_s"] == 19 and row["recovered"]


def test_a_failure_with_no_record_after_it_is_reported_as_not_recovered(goodput):
    kept = goodput.kept_records([record(5, 1), record(10, 2), record(15, 3)])
    events = [{"host": "host2", "killed": 3.5, "killed_rel": 2.5, "back": 12, "back_rel": 11, "t0": 1.0}]
    (row,) = goodput.failure_rows(kept, events, pace=1.0)
    assert row["recovered"] is False and "stall_s" not in row and "workers_after" not in row


def test_the_launchers_start_tasks_warm_unless_told_not_to(bench, goodput, tmp_path):
    for argv, flag in (([], "--warm-start"), (["--no-warm-start"], "--no-warm-start")):
        args = bench.parse_args(["--section", "goodput", *argv])
        goodput.settle(args)
        job = goodput.Job(None, tmp_path / flag, tmp_path, args)
        assert flag in job.common and job.common[job.common.index("--epochs") + 1] == str(goodput.EPOCHS)


def test_the_schedule_kills_each_worker_host_in_turn_within_the_window(bench, goodput):
    args = bench.parse_args(["--section", "goodput"])
    goodput.settle(args)
    assert (args.duration, args.period, args.down) == (600, 60, 30)
    kills = [(t, host) for t, what, host in goodput.schedule(args, failures=True) if what == "kill"]
    assert kills == [(60 * k, 1 + (k - 1) % 3) for k in range(1, 10)]
    assert ("start" in {what for _, what, _ in goodput.schedule(args, True)}) and goodput.schedule(args, False) == []
    quick = bench.parse_args(["--quick", "--section", "goodput"])
    goodput.settle(quick)
    assert [(t, w) for t, w, _ in goodput.schedule(quick, True)] == [(45, "kill"), (65, "start")]
    bad = bench.parse_args(["--section", "goodput", "--checkpoint-every", "12"])
    with pytest.raises(ValueError, match="multiple of 5"):
        goodput.settle(bad)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.serial  # four namespace hosts of a job each, and the stalls are wall time
@pytest.mark.timeout(900)
def test_quick_goodput_run_on_namespace_hosts(bench, tmp_path, capsys):
    reason = hosts_module.unavailable()
    if reason:
        pytest.skip(reason)
    assert bench.main(["--section", "goodput", "--quick", "--out", str(tmp_path), "--dir", str(tmp_path)]) == 0
    mine = f"{hosts_module.PREFIX}{os.getpid()}x"  # (other processes may make hosts meanwhile)
    assert not [ns for ns in hosts_module._namespaces() if ns.startswith(mine)]  # the hosts were removed
    report = json.loads((tmp_path / "elastic-latest.json").read_text())
    section = report["sections"]["goodput"]
    free, fail = section["runs"]["failure_free"], section["runs"]["failures"]
    assert report["errors"] == [], fail.get("node0_tail")
    assert fail["never_stops"]  # every launcher that ended by itself exited 0, and no gap went past --period
    assert free["never_stops"] and free["exits"] == [] and free["stopped_at_end"] == [0, 1, 2, 3]
    assert fail["exits"] == [{"host": 1, "status": -9, "killed": True}]  # the failure; the end is no exit of the run
    assert fail["stopped_at_end"] == [0, 1, 2, 3] and free["outlasted_window"] and fail["outlasted_window"]
    assert [(e["host"], e["killed_rel"] >= 45) for e in fail["events"]] == [("host1", True)]
    (row,) = fail["failures"]
    assert row["recovered"] and row["workers_after"] == 3 and row["stall_s"] > 0, row
    assert {"detect_s", "stop_s", "rendezvous_s", "start_up_s"} <= set(row)  # node 0's restarts.json: the regroup
    # the host lost; back at the next checkpoint or loss, which a loaded machine may not reach before the quick
    # run ends (round 0 may also start below 4 there: the others join at a checkpoint)
    after = [w for t, w in fail["world"] if t > row["killed_s"]]
    assert after[:1] == [3] and after[1:2] in ([], [4]), fail["world"]
    assert free["samples_kept"] > 0 and 0 < section["derived"]["goodput"] < 2
    assert section["table"] in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("conveyor-elastic")] == []
