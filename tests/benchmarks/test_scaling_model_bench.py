"""benchmarks/scaling_model.py: the published part end to end (no processes), the measured part's pieces.

The measured part trains the CIFAR-10 example for minutes, so only what it is made of is checked here:
the job commands, the description of this machine as a cluster, and the prediction from a 1-worker
summary. Every input of every published case must name where it comes from.
"""

from __future__ import annotations

import json
import math

import pytest

BENCHMARK = "scaling_model"


def test_every_published_input_names_its_source(bench):
    data = json.loads(bench.DATA.read_text())
    for case in data["cases"]:
        assert case["published"]["source"] in data["sources"], case["name"]
        for key in ("batch_size", "images_per_second", "compute_seconds", "overhead_seconds", "parameters",
                    "bucket_bytes"):
            if key in case:
                entry = case[key]
                assert "value" in entry and {"source", "derived", "assumed"} & set(entry), (case["name"], key)
        assert case["cluster"] in data["clusters"] and "sources" in data["clusters"][case["cluster"]]
    for entry in data["assumptions"].values():
        assert "value" in entry and entry["assumed"]


def test_the_published_part_writes_its_table_and_json(bench, tmp_path, capsys):
    assert bench.main(["--part", "published", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "horovod-512-vgg-16" in out and "goyal-256-resnet-50" in out
    report = json.loads((tmp_path / "scaling_model-latest.json").read_text())
    rows = {r["case"]: r for r in report["published"]}
    assert len(rows) == len(json.loads(bench.DATA.read_text())["cases"])
    for r in rows.values():
        assert 0 < r["predicted_efficiency"] <= 1 and math.isfinite(r["gap_points"])
        assert r["gap_points"] == pytest.approx(100 * (r["predicted_efficiency"] - r["published_efficiency"]))
    # VGG-16 moves 4x the bytes of Inception V3 in about the same compute: it must scale worse
    assert rows["horovod-512-vgg-16"]["predicted_efficiency"] < rows["horovod-512-inception-v3"]["predicted_efficiency"]
    assert report["measured"] is None and len(report["goals"]) == len(rows)


def test_parse_args(bench):
    args = bench.parse_args([])
    assert (args.part, args.repeats, args.steps, args.batch_size) == ("all", 3, 30, 64)
    assert (bench.parse_args(["--quick"]).repeats, bench.parse_args(["--quick"]).steps) == (1, 10)
    for bad in (["--part", "papers"], ["--steps", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_job_commands(bench, tmp_path):
    settings = {"steps": 10, "batch_size": 64}
    one = bench.job_command("1-worker", settings, tmp_path)
    assert one[one.index("-n") + 1] == "1" and "--strategy" not in one and "--synthetic" in one
    ps = bench.job_command("ps-sync", settings, tmp_path)
    assert ps[ps.index("-n") + 1] == "2" and ps[ps.index("--strategy") + 1] == "ps-sync" and "--ps" in ps
    assert int(ps[ps.index("--synthetic-size") + 1]) >= 10 * 64 * 2  # no epoch ends inside the run
    ar = bench.job_command("allreduce", settings, tmp_path)
    assert "--ps" not in ar and ar[ar.index("--max-steps") + 1] == "10"


def test_this_machine_predicts_two_workers_from_one(bench):
    cluster = bench.local_cluster({"bus_bandwidth": 1e9, "latency": 1e-4}, cores=2)
    assert cluster.gpus_per_node == 2 and cluster.cores_per_gpu == 1 and cluster.compute_shares_cores
    summary = {"strategy": "local", "world_size": 1,
               "step_breakdown": {"input_wait": 0.0, "forward_backward": 1.0, "communication": 0.0,
                                  "optimizer": 0.01, "total": 1.02},
               "scaling": {"batch_size": 64, "parameter_bytes": 1e6, "gradient_bytes": 1e6,
                           "input_core_seconds_per_batch": 0.05}}
    assert bench.step_rate(summary) == pytest.approx(64 / 1.02)
    predicted = bench.predict_two(summary, cluster)
    assert set(predicted) == set(bench.PREDICTED)
    # two workers, each paying its own input on its one core and a 1 MB all-reduce: a bit under twice one
    assert 1.7 * 64 / 1.02 < predicted["allreduce"] < 2 * 64 / 1.02
    assert predicted["ps-sync"] < 2 * 64 / 1.02
