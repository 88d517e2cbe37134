"""`conveyor predict`: the table, the JSON and the plot from a summary.json and a cluster file; one-line errors."""

from __future__ import annotations

import json

import pytest

from conveyor.cli.main import main

CLUSTER = {"name": "test cluster", "gpus_per_node": 4, "cores_per_gpu": 2, "intra_node_bandwidth": "10 GB/s",
           "intra_node_latency": "5 us", "inter_node_bandwidth": "10 Gbit/s", "inter_node_latency": "10 us",
           "ps_count": 2}
SUMMARY = {"strategy": "local", "world_size": 1, "steps": 20,
           "step_breakdown": {"input_wait": 0.0, "forward_backward": 0.2, "communication": 0.0, "optimizer": 0.01,
                              "total": 0.21},
           "scaling": {"batch_size": 64.0, "parameter_bytes": 50_000_000, "gradient_bytes": 50_000_000,
                       "input_core_seconds_per_batch": 0.1, "device": "cpu"}}


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps(SUMMARY))
    (tmp_path / "cluster.json").write_text(json.dumps(CLUSTER))
    return tmp_path


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("conveyor predict: error: ") or "error:" in err
    for needle in needles:
        assert needle in err, err
    return err


def test_predict_prints_writes_and_plots(run_dir, capsys):
    assert main(["predict", str(run_dir / "run"), "--cluster", str(run_dir / "cluster.json"),
                 "--workers", "1,4,16,64", "--stages", "4"]) == 0
    out = capsys.readouterr().out
    assert "test cluster" in out and "allreduce: ring all-reduce (flat)" in out and "pipeline:" in out
    assert "efficiency" in out and "bound" in out
    doc = json.loads((run_dir / "run" / "prediction" / "prediction.json").read_text())
    assert doc["cluster"]["gpus_per_node"] == 4 and doc["measured"]["batch_size"] == 64
    assert doc["options"]["overlap"] == 0.5
    points = {(p["strategy"], p["workers"]): p for p in doc["points"]}
    assert points[("allreduce", 1)]["efficiency"] == pytest.approx(1.0)
    assert {p["bound"] for p in doc["points"]} <= {"input", "compute", "communication", "bubble", "server"}
    assert ("pipeline", 1) not in points and ("pipeline", 4) in points
    assert (run_dir / "run" / "prediction" / "prediction.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flags_override_the_cluster_file_and_supply_it(run_dir, capsys):
    out_dir = run_dir / "elsewhere"
    assert main(["predict", str(run_dir / "run" / "summary.json"), "--cluster", str(run_dir / "cluster.json"),
                 "--compute-speed", "2", "--workers", "1", "--strategies", "allreduce", "--out", str(out_dir),
                 "--no-plot", "--batch-size", "128"]) == 0
    doc = json.loads((out_dir / "prediction.json").read_text())
    assert doc["cluster"]["compute_speed"] == 2.0 and doc["measured"]["batch_size"] == 128
    assert doc["points"][0]["step_seconds"] == pytest.approx((0.2 + 0.01) / 2)
    assert not (out_dir / "prediction.png").exists()
    capsys.readouterr()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in CLUSTER.items() if k not in ("name",)]
    assert main(["predict", str(run_dir / "run"), *flags, "--workers", "1,8", "--out", str(out_dir), "--no-plot"]) == 0


def test_a_missing_summary_is_one_line(run_dir, capsys):
    assert main(["predict", str(run_dir / "nowhere"), "--cluster", str(run_dir / "cluster.json")]) == 2
    _one_line_error(capsys, "nowhere", "No such file")


def test_a_summary_without_the_fields_is_one_line(run_dir, capsys):
    (run_dir / "run" / "summary.json").write_text(json.dumps({**SUMMARY, "scaling": {"batch_size": 64}}))
    assert main(["predict", str(run_dir / "run"), "--cluster", str(run_dir / "cluster.json")]) == 2
    _one_line_error(capsys, "summary.json", "scaling.gradient_bytes", "--gradient-bytes")
    (run_dir / "run" / "summary.json").write_text("{")
    assert main(["predict", str(run_dir / "run"), "--cluster", str(run_dir / "cluster.json")]) == 2
    _one_line_error(capsys, "summary.json", "not valid JSON")


def test_a_malformed_cluster_file_is_one_line(run_dir, capsys):
    (run_dir / "cluster.json").write_text(json.dumps({**CLUSTER, "inter_node_bandwidth": "lots"}))
    assert main(["predict", str(run_dir / "run"), "--cluster", str(run_dir / "cluster.json")]) == 2
    _one_line_error(capsys, "cluster.json", "inter_node_bandwidth", "Gbit/s")
    (run_dir / "cluster.json").write_text('{"gpus_per_node": 4,}')
    assert main(["predict", str(run_dir / "run"), "--cluster", str(run_dir / "cluster.json")]) == 2
    _one_line_error(capsys, "cluster.json", "not valid JSON", "line 1")


def test_no_cluster_at_all_says_what_to_give(run_dir, capsys):
    assert main(["predict", str(run_dir / "run")]) == 2
    _one_line_error(capsys, "missing intra_node_bandwidth", "--intra-node-bandwidth")


@pytest.mark.parametrize("extra", [["--workers", "1,x"], ["--workers", "0"], ["--strategies", "horovod"],
                                   ["--overlap", "2"], ["--gpus-per-node", "four"]])
def test_bad_flags_are_one_line(run_dir, capsys, extra):
    assert main(["predict", str(run_dir / "run"), "--cluster", str(run_dir / "cluster.json"), *extra]) == 2
    _one_line_error(capsys, "error:")
