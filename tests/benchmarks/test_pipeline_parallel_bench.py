"""Smoke test of benchmarks/pipeline_parallel.py: `--quick` runs real pipeline processes and writes a sane JSON.

Not a performance assertion: rates are checked to be positive and finite, the bubble and activation
figures to be in range. To stay within ~30 s on a loaded 2-core machine it runs conveyor's contender
only (the other two are then "not measured", which the goals must report as FAIL, not PASS).
"""

from __future__ import annotations

import json
import math

import pytest

from numbers_check import finite_positive

BENCHMARK = "pipeline_parallel"


def test_parse_args(bench):
    args = bench.parse_args([])
    assert (args.width, args.depth, args.batch, args.microbatches, args.sweep) == (2048, 64, 256, 2, (2, 4, 8, 16))
    quick = bench.parse_args(["--quick"])
    assert (quick.width, quick.depth, quick.repeats, quick.sweep, quick.paired_steps) == (256, 4, 1, (16,), 2)
    for bad in (["--batch", "30"], ["--sweep", "2,7"], ["--depth", "3"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_saved_bytes_counts_each_saved_tensor_once_and_frees_it(bench):
    import torch

    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def step():
        torch.relu(layer(x)).sum().backward()

    got = bench.saved_activations(step, list(layer.parameters()), microbatches=1)
    # Linear saves its input (4x8 floats; the weight is a parameter), relu its output (4x8): 256 bytes
    assert got["total_bytes"] == 256 and got["peak_bytes"] == 256
    assert got["left_live_bytes"] == 0 and got["peak_microbatches"] == 1.0


def test_theory_and_goals_are_data(bench):
    assert bench.theory(2, 2) == pytest.approx(1 / 3) and bench.theory(2, 16) == pytest.approx(1 / 17)
    assert {g.key for g in bench.GOALS} == {"memory_ratio_2", "bubble_max_gap", "conveyor_vs_bare_paired",
                                            "conveyor_vs_ideal", "act_1f1b", "act_gpipe_share"}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.serial  # a quick benchmark run: each round has a 25-50 s bound that a test on the other core can break
def test_quick_run_writes_json(bench, tmp_path, capsys):
    assert bench.main(["--quick", "--contenders", "conveyor_pipeline", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    latest = tmp_path / "pipeline_parallel-latest.json"
    report = json.loads(latest.read_text())
    assert report["benchmark"] == "pipeline_parallel" and report["errors"] == []
    assert report["machine"]["cores"] >= 1 and report["machine"]["loadavg_start"] is not None
    assert report["config"]["quick"] is True and report["config"]["order"] == ["conveyor_pipeline"]

    d = report["derived"]
    run = report["runs"]["conveyor_pipeline"][0]
    assert finite_positive(report["samples"]["conveyor_pipeline"][0]) and run["threads"] == [1, 1]
    assert len(run["peak_rss_mb"]) == 2 and all(finite_positive(x) for x in run["peak_rss_mb"])
    mem = d["memory"]["conveyor_pipeline"]  # the largest process's phases: imports <= built, peaks cover them
    assert 0 < mem["import_rss_mb"] <= mem["built_rss_mb"] <= mem["setup_peak_rss_mb"] <= mem["peak_rss_mb"]
    assert mem["train_peak_rss_mb"] <= mem["peak_rss_mb"]
    rows = {(r["schedule"], r["microbatches"]): r for r in d["bubble"]}
    assert set(rows) == {("gpipe", 16), ("1f1b", 16)}
    for r in rows.values():
        assert r["theory"] == pytest.approx(1 / 17) and all(0 <= b < 1 for b in r["measured"])
    # the schedules' defining difference, measured: 1F1B's first stage holds S microbatches, GPipe's all M
    assert d["act_1f1b"] == pytest.approx(2.0, abs=0.05) and d["act_gpipe_share"] == pytest.approx(1.0, abs=0.01)

    goals = {g["name"]: g for g in report["goals"]}
    assert len(goals) == 6 and report["all_pass"] == all(g["pass"] for g in goals.values())
    for g in goals.values():
        measured = g["value"] is not None and math.isfinite(g["value"])
        assert measured or not g["pass"], g  # a contender left out never passes a goal
        assert ("PASS " if g["pass"] else "FAIL ") + g["name"] in printed
    assert not goals["throughput: conveyor_pipeline / (S x (1 - bubble) x one_process)"]["pass"]  # not run
    # the paired run (both pipelines in one pair of processes, a step of each in turn) ran whatever --contenders say
    paired = report["paired"]
    assert len(paired["seconds"]["conveyor"]) == len(paired["seconds"]["bare"]) == len(paired["per_pair"]) == 2
    assert finite_positive(d["conveyor_vs_bare_paired"]) and d["conveyor_vs_bare_paired"] == paired["conveyor_vs_bare"]
    assert "step by step in one pair of processes" in report["table"]
    assert report["table"] in printed and "1f1b" in report["table"]


def test_cuda_without_two_gpus_is_skipped_with_the_reason(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "cuda_devices", lambda: 1)
    assert bench.main(["--quick", "--device", "cuda", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "pipeline_parallel-latest.json").read_text())
    assert report["skipped"] == ("--device cuda needs 2 GPUs (one process per GPU: NCCL refuses two ranks on one "
                                 "GPU); this machine has 1") and report["config"]["device"] == "cuda"
    assert "skipped" in capsys.readouterr().out and "runs" not in report


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_cuda_on_this_machines_gpus_runs_or_says_why_not(bench, tmp_path):
    gpus = bench.cuda_devices()
    if gpus == 0:
        pytest.skip("needs a CUDA device")
    assert bench.main(["--quick", "--device", "cuda", "--contenders", "conveyor_pipeline", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "pipeline_parallel-latest.json").read_text())
    if gpus < 2:  # one GPU: the reason, with the real count
        assert report["skipped"].endswith(f"this machine has {gpus}") and "runs" not in report
    else:
        assert not report.get("skipped") and report["runs"] and report["config"]["device"] == "cuda"


def test_cpu_runs_hide_the_gpus_and_cuda_runs_keep_them(bench):
    assert bench._base_env("cpu")["CUDA_VISIBLE_DEVICES"] == ""
    assert bench._base_env("cuda").get("CUDA_VISIBLE_DEVICES") != ""
