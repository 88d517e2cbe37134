"""Smoke test of benchmarks/allreduce.py: the workers run a tiny model and the report is sane.

Not a performance assertion: rates are only checked to be positive and finite, shares to be in [0, 1].
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conveyor.launch import OWNED_VARS
from numbers_check import finite_positive

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--batch", "8", "--steps", "3", "--warmup", "1", "--comm-steps", "2", "--repeats", "1",
        "--paired-steps", "3"]


BENCHMARK = "allreduce"


def test_parse_args(bench):
    args = bench.parse_args([])
    assert (args.steps, args.warmup, args.repeats, args.batch, args.comm_steps) == (30, 5, 3, 64, 10)
    assert (args.paired_steps, args.paired_runs, args.paired_only) == (40, 3, False)
    assert args.contenders == list(bench.CONTENDERS) and args.model == "resnet20"
    quick = bench.parse_args(["--quick"])
    assert (quick.steps, quick.repeats) == (10, 1)
    assert bench.parse_args(["--quick", "--steps", "7"]).steps == 7
    assert (quick.paired_steps, quick.paired_runs) == (10, 1)
    assert bench.parse_args(["--repeats", "2", "--paired-runs", "5"]).paired_runs == 5
    assert bench.parse_args(["--contenders", "conveyor_2,bare_ddp_2"]).contenders == ["bare_ddp_2", "conveyor_2"]
    for bad in (["--contenders", "horovod"], ["--steps", "0"], ["--comm-steps", "-1"], ["--paired-runs", "0"],
                ["--paired-only", "--paired-steps", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_model_is_resnet20_sized(bench):
    model = bench.make_model()
    params = sum(p.numel() for p in model.parameters())
    assert 0.25e6 < params < 0.29e6 and params == bench.count_params("resnet20")
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) >= 19
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_single_worker_contenders_in_process(bench, tmp_path, monkeypatch):
    """bare_ddp_1 and conveyor_1 (no process group) run the same loop in this process."""
    for var in OWNED_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CONVEYOR_OUTPUT_DIR", str(tmp_path / "output"))
    monkeypatch.setenv("CONVEYOR_DATA_DIR", str(tmp_path / "data"))
    threads = torch.get_num_threads()
    try:
        for contender in ("bare_ddp_1", "conveyor_1"):
            out = tmp_path / contender
            out.mkdir()
            config = {"contender": contender, "model": "tiny", "batch": 4, "warmup": 1, "steps": 2,
                      "comm_steps": 0, "result_dir": str(out)}
            result = bench.worker(config)
            assert json.loads((out / "rank0.json").read_text()) == result
            assert result["world"] == 1 and result["threads"] == 1 and result["comm_share"] is None
            assert finite_positive(result["samples_per_s"]) and len(result["step_ms"]) == 2
            assert finite_positive(result["cpu_ms_per_step"]) and result["comm_ms_per_step"] is None
            assert math.isfinite(result["first_loss"]) and math.isfinite(result["last_loss"])
            if contender == "conveyor_1":
                assert result["strategy"] == "local"
    finally:
        torch.set_num_threads(threads)


def fake_run(sps: float, world: int, share: float | None = None, hook: float | None = None):
    run = {"samples_per_s": sps, "step_ms_median": 1000.0, "forward_ms_median": 300.0,
           "backward_ms_median": 600.0, "optimizer_ms_median": 5.0, "comm_share": share,
           "ranks_in_sync": True, "fingerprints": [1.0] * world}
    if hook is not None:
        run.update(hook_pass={"samples_per_s": hook}, isolated_comm_share=0.01, isolated_allreduce_ms=1.0)
    return run


def test_derive_report_and_json_from_known_samples(bench, tmp_path):
    samples = {"bare_ddp_1": [100.0, 110.0], "bare_ddp_2": [180.0, 190.0], "conveyor_2": [171.0, 200.0],
               "conveyor_1": [100.0, 100.0]}
    runs = {c: [fake_run(x, bench.WORLD[c], 0.1 if bench.WORLD[c] == 2 else None,
                         hook=170.0 if c == "bare_ddp_2" else None) for x in v] for c, v in samples.items()}
    d = bench.derive({"samples": samples, "runs": runs})
    assert d["median"]["bare_ddp_2"] == 185.0
    assert d["conveyor_vs_bare_2"] == pytest.approx(185.5 / 185.0)
    assert d["conveyor_vs_bare_2_per_round"] == pytest.approx([0.95, 200 / 190])
    assert d["scaling_efficiency"]["bare_ddp"] == pytest.approx(185.0 / (2 * 105.0))
    assert d["scaling_efficiency"]["conveyor"] == pytest.approx(185.5 / 200.0)
    assert d["comm_share"]["conveyor_2"]["median"] == pytest.approx(0.1)
    assert d["comm_share"]["bare_ddp_2_isolated"]["median"] == pytest.approx(0.01)
    assert all(d["comm_share"][k]["method"] for k in ("conveyor_2", "bare_ddp_2", "bare_ddp_2_isolated"))
    assert not bench.goals(d)[0]["pass"]  # the goal is the paired figure: without paired runs, not measured

    # Paired runs: per pair bare's step time / conveyor's, over every pair of every run; a failed run is left out.
    def paired_run(conveyor, bare):
        return {"seconds": {"conveyor": conveyor, "bare": bare}, "cpu_seconds": {"conveyor": conveyor, "bare": bare},
                "comm_s": 0.1 * sum(conveyor), "ranks_in_sync": True}

    p = bench.derive_paired([paired_run([1.0, 2.0], [1.0, 2.2]), None, paired_run([1.0], [0.9])])
    assert p["median"] == pytest.approx(1.0) and p["min"] == pytest.approx(0.9) and p["max"] == pytest.approx(1.1)
    assert p["pairs"] == 3 and p["runs"] == 3 and p["runs_done"] == 2
    assert p["ratio_of_sums"] == pytest.approx(4.1 / 4.0)
    assert p["per_run_median"][0] == pytest.approx(1.05) and p["per_run_median"][1] is None
    assert p["conveyor_comm_share"] == pytest.approx(0.1) and p["ranks_in_sync"] is True and p["method"]
    d["paired"], d["conveyor_vs_bare_2_paired"] = p, p["median"]
    goals = bench.goals(d)
    assert goals[0]["pass"] and bench.format_goals(goals).startswith("PASS ")

    config = {"model": "tiny", "params": 123, "batch": 8, "steps": 3, "warmup": 1}
    table = bench.format_table({"samples": samples}, d, config)
    for word in (*bench.CONTENDERS, "bare_ddp_2+hook", "scaling efficiency", "comm share", "paired",
                 "median of 3 per-pair ratios", "min 0.900, max 1.100"):
        assert word in table

    # A contender that failed (NaN) or was left out makes the goal "not measured", and the JSON stays strict.
    partial = bench.derive({"samples": {"bare_ddp_2": [math.nan]}, "runs": {"bare_ddp_2": [None]}})
    assert math.isnan(partial["conveyor_vs_bare_2"]) and not bench.goals(partial)[0]["pass"]
    assert "not measured" in bench.format_goals(bench.goals(partial))
    path = bench.write_json({"derived": partial, "samples": {"bare_ddp_2": [math.nan]}}, tmp_path)
    data = json.loads((tmp_path / "allreduce-latest.json").read_text())
    assert path.name.startswith("allreduce-") and data["samples"]["bare_ddp_2"] == [None]


@pytest.mark.multiprocess
@pytest.mark.timeout(480)  # three pairs of processes (bare, conveyor, paired): ~40 s quiet, 4.5 min at load 22
def test_two_worker_cli_smoke(bench, tmp_path, capsys):
    """The CLI starts bare DDP and conveyor with 2 processes each, then the paired run; tiny model, a few steps."""
    out = tmp_path / "results"
    assert bench.main([*TINY, "--contenders", "bare_ddp_2,conveyor_2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "conveyor_2 / bare_ddp_2" in printed and ("PASS " in printed or "FAIL " in printed)

    data = json.loads((out / "allreduce-latest.json").read_text())
    assert [p.name for p in out.glob("allreduce-2*.json")] and data["benchmark"] == "allreduce"
    assert data["machine"]["cores"] >= 1 and data["machine"]["torch"] == torch.__version__
    assert data["config"]["model"] == "tiny" and data["config"]["steps"] == 3 and data["config"]["batch"] == 8
    assert data["errors"] == []
    for c in ("bare_ddp_2", "conveyor_2"):
        assert len(data["samples"][c]) == 1 and finite_positive(data["samples"][c][0])
        run = data["runs"][c][0]
        assert run["world"] == 2 and run["threads"] == 1 and run["omp_num_threads"] == "1"
        assert run["ranks_in_sync"] and len(run["fingerprints"]) == 2 and len(run["step_ms"]) == 3
        assert 0 <= run["comm_share"] <= 1 and run["comm_method"] and run["comm_ms_per_step"] >= 0
        assert finite_positive(run["cpu_ms_per_step"]) and finite_positive(run["step_ms_median"])
    conv = data["runs"]["conveyor_2"][0]
    assert conv["strategy"] == "allreduce" and conv["ddp"] is True
    bare = data["runs"]["bare_ddp_2"][0]
    assert finite_positive(bare["isolated_allreduce_ms"]) and finite_positive(bare["hook_pass"]["samples_per_s"])

    d = data["derived"]
    assert finite_positive(d["conveyor_vs_bare_2"])
    paired = d["paired"]
    assert paired["pairs"] == 3 and paired["runs_done"] == 1 and paired["ranks_in_sync"] is True
    assert finite_positive(paired["median"]) and paired["min"] <= paired["median"] <= paired["max"]
    assert d["conveyor_vs_bare_2_paired"] == paired["median"] and 0 <= paired["conveyor_comm_share"] <= 1
    run = data["paired_runs"][0]
    assert run["strategy"] == "allreduce" and run["threads"] == 1 and run["comm_s"] > 0
    assert [len(run["seconds"][k]) for k in ("conveyor", "bare")] == [3, 3]
    assert "conveyor_2 / bare_ddp_2, paired" in printed
    assert d["conveyor_vs_bare_2"] == pytest.approx(data["samples"]["conveyor_2"][0] / data["samples"]["bare_ddp_2"][0])
    assert d["scaling_efficiency"] == {"bare_ddp": None, "conveyor": None}  # 1-worker contenders left out
    for key in ("conveyor_2", "bare_ddp_2", "bare_ddp_2_isolated"):
        assert 0 <= d["comm_share"][key]["median"] <= 1 and d["comm_share"][key]["method"]
    assert d["ranks_in_sync"] == {"bare_ddp_2": True, "conveyor_2": True}
    assert len(data["goals"]) == 1 and isinstance(data["goals"][0]["pass"], bool)
    assert data["all_pass"] == data["goals"][0]["pass"]
