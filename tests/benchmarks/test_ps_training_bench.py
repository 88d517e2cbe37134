"""Smoke test of benchmarks/ps_training.py: `--quick` trains the digits example under the straggler pair
(real `conveyor run` jobs: 2 workers, 1 ps task, ps-sync then ps-async) and writes a sane JSON.

Only the two straggler contenders run (1 epoch each, ~25 s on 2 cores): they are the ones the goals
are computed from and the ones that exercise the straggler callback; the plain contenders differ from
them only in the `conveyor run` arguments. Not a performance assertion: rates are only checked to be
positive and finite, accuracies to be in [0, 1], goal values to be finite.
"""

from __future__ import annotations

import json
import math

import pytest

from numbers_check import finite_positive

BENCHMARK = "ps_training"
PAIR = ("ps-sync+straggler", "ps-async+straggler")


def test_parse_args(bench):
    args = bench.parse_args([])
    assert (args.repeats, args.epochs, args.lr, args.batch_size, args.slowdown) == (3, 8, 0.02, 32, 2.0)
    assert args.contenders == bench.CONTENDERS
    quick = bench.parse_args(["--quick"])
    assert (quick.repeats, quick.epochs) == (1, 1)
    assert bench.parse_args(["--quick", "--epochs", "2"]).epochs == 2
    # a subset comes back in the canonical round order, duplicates dropped
    assert bench.parse_args(["--contenders", "ps-async,allreduce,ps-async"]).contenders == ("allreduce", "ps-async")
    for bad in (["--repeats", "0"], ["--epochs", "-1"], ["--lr", "0"], ["--slowdown", "0.5"],
                ["--contenders", "ps-sync,nope"], ["--contenders", ","]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_job_command(bench, tmp_path):
    settings = {"epochs": 2, "lr": 0.02, "batch_size": 32, "seed": 0, "slowdown": 2.0, "checkpoint_every": 50}
    ar = bench.job_command("allreduce", settings, tmp_path / "d", tmp_path / "o")
    assert "--ps" not in ar and ar[ar.index("--strategy") + 1] == "allreduce"
    slow = bench.job_command("ps-async+straggler", settings, tmp_path / "d", tmp_path / "o")
    assert slow[slow.index("--ps") + 1] == "1" and slow[slow.index("--strategy") + 1] == "ps-async"
    config = json.loads(slow[slow.index("--train") + 1])
    assert config["straggler"] is True and config["epochs"] == 2 and config["lr"] == 0.02


def test_straggler_sleeps_its_busy_time(bench, monkeypatch):
    slept = []
    monkeypatch.setattr(bench.time, "sleep", slept.append)

    class Times:
        total, input_wait = 0.5, 0.1

    class Event:
        times = Times()

    straggler = bench.Straggler(2.0)
    straggler(Event())
    straggler(Event())
    assert slept == pytest.approx([0.4, 0.4])
    assert straggler.steps == 2 and straggler.slept_seconds == pytest.approx(0.8)


@pytest.mark.multiprocess
@pytest.mark.serial  # a quick benchmark run: each round has a 25-50 s bound that a test on the other core can break
def test_quick_straggler_pair_writes_json(bench, tmp_path, capsys):
    assert bench.main(["--quick", "--contenders", ",".join(PAIR), "--out", str(tmp_path), "--timeout", "50"]) == 0
    printed = capsys.readouterr().out
    latest = tmp_path / "ps_training-latest.json"
    stamped = [p for p in tmp_path.glob("ps_training-*.json") if p.name != latest.name]
    assert latest.exists() and len(stamped) == 1 and stamped[0].read_text() == latest.read_text()
    report = json.loads(latest.read_text())

    assert report["benchmark"] == "ps_training" and report["errors"] == []
    assert report["machine"]["cores"] >= 1 and "conveyor" in report["machine"]
    config = report["config"]
    assert config["quick"] is True and config["repeats"] == 1 and config["epochs"] == 1
    assert config["contenders"] == list(PAIR) and sorted(config["order"]) == sorted(PAIR)

    for c in PAIR:
        s = report["samples"][c]
        assert all(len(s[m]) == 1 for m in bench.METRICS)
        for m in ("steps_per_second", "samples_per_second", "wall_seconds"):
            assert finite_positive(s[m][0]) and finite_positive(report["derived"][f"median_{m}"][c])
        assert 0.0 <= s["eval_accuracy"][0] <= 1.0
        run = report["runs"][c][0]
        assert run["strategy"] == c.partition("+")[0] and run["world_size"] == 2
        assert run["samples"] >= run["steps"] * config["batch_size"]
        assert run["communication"]["push_seconds"] > 0
        straggler = run["straggler"]  # written by worker 1 itself
        assert straggler["rank"] == 1 and straggler["steps"] >= 1 and straggler["slept_seconds"] > 0
        assert straggler["slept_seconds"] == pytest.approx(straggler["busy_seconds"])  # 2x: sleep = busy time
    sync_steps = report["derived"]["worker_steps"]["ps-sync+straggler"][0]
    assert sync_steps[0] == sync_steps[1]  # lockstep: both workers do every step

    d = report["derived"]
    assert finite_positive(d["straggler_async_vs_sync_samples_per_second"])
    assert math.isfinite(d["straggler_accuracy_gap"]) and 0.0 <= d["straggler_accuracy_gap"] <= 1.0
    assert [(g["compare"], g["threshold"]) for g in report["goals"]] == [(">=", 1.5), ("<=", 0.02)]
    assert report["all_pass"] == all(g["pass"] for g in report["goals"])
    for g in report["goals"]:
        assert g["pass"] == (g["value"] >= g["threshold"] if g["compare"] == ">=" else g["value"] <= g["threshold"])
        assert ("PASS " if g["pass"] else "FAIL ") + g["name"] in printed
    assert report["table"] in printed
