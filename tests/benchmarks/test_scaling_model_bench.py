"""benchmarks/scaling_model.py: the published part end to end (no processes), the measured part's pieces.

The measured part trains the CIFAR-10 example for minutes, so mostly what it is made of is checked here:
the job commands, the description of this machine and of namespace hosts as clusters, and the prediction
from a 1-worker summary. Every input of every published case must name where it comes from. As root, the
``--hosts 2`` variant also runs end to end with tiny jobs at one cap: a smoke run, not a validation (~40 s on
an idle machine, mostly process start-up; ~100 s on a busy one).
"""

from __future__ import annotations

import json
import math

import pytest

from conveyor.testing.hosts import unavailable

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
    assert (args.part, args.repeats, args.steps, args.batch_size, args.hosts) == ("all", 3, 30, 64, None)
    assert (bench.parse_args(["--quick"]).repeats, bench.parse_args(["--quick"]).steps) == (1, 10)
    hosts = bench.parse_args(["--part", "measured", "--hosts", "3", "--caps", "10,none"])
    assert (hosts.hosts, hosts.caps) == (3, (10.0, None))
    default = bench.parse_args(["--hosts", "2"])
    assert (default.caps, default.repeats, default.steps) == ((10.0, 100.0, 1000.0), 2, 30)
    for bad in (["--part", "papers"], ["--steps", "0"], ["--repeats", "0"], ["--hosts", "4"], ["--caps", "20"],
                ["--hosts", "2", "--part", "published"], ["--hosts", "2", "--caps", "fast"]):
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


SUMMARY = {"strategy": "local", "world_size": 1, "samples_per_second": 60.0,
           "step_breakdown": {"input_wait": 0.0, "forward_backward": 1.0, "communication": 0.0, "optimizer": 0.01,
                              "total": 1.02},
           "scaling": {"batch_size": 64, "parameter_bytes": 1e6, "gradient_bytes": 1e6,
                       "input_core_seconds_per_batch": 0.05}}


def test_this_machine_predicts_two_workers_from_one(bench):
    site = bench.local_site({"bus_bandwidth": 1e9, "latency": 1e-4}, cores=2)
    cluster = site.clusters["allreduce"]
    assert cluster.gpus_per_node == 2 and cluster.cores_per_gpu == 1 and cluster.compute_shares_cores
    assert site.contenders == bench.CONTENDERS and set(site.clusters) == set(site.labels) == set(bench.PREDICTED)
    assert bench.step_rate(SUMMARY) == pytest.approx(64 / 1.02)
    predicted = {c: p.samples_per_second for c, p in bench.predict_site(SUMMARY, site.clusters).items()}
    assert set(predicted) == set(bench.PREDICTED)
    # two workers, each paying its own input on its one core and a 1 MB all-reduce: a bit under twice one
    assert 1.7 * 64 / 1.02 < predicted["allreduce"] < 2 * 64 / 1.02
    assert predicted["ps-sync"] < 2 * 64 / 1.02
    slower = bench.predict_site(SUMMARY, site.clusters, speed=0.5)["allreduce"].samples_per_second
    assert slower < 0.6 * predicted["allreduce"]  # half the compute speed: the 1 s compute doubles


def test_a_ring_probe_gives_bus_bandwidth_and_latency(bench):
    link = bench.link_figures(big_seconds=0.0422, small_seconds=0.0002, nbytes=4_000_000)
    assert link["latency"] == pytest.approx(1e-4)  # 2 processes: a ring of 2 steps
    assert link["bus_bandwidth"] == pytest.approx(4_000_000 / 0.042)  # 2(N-1)/N x bytes over the wire time


def test_namespace_hosts_as_clusters_one_per_cap(bench, tmp_path):
    links = {"20": {"bus_bandwidth": 2.4e6, "latency": 2e-4, "cap_mbit": 20.0},
             "1000": {"bus_bandwidth": 1.2e8, "latency": 1e-4, "cap_mbit": 1000.0}}
    site = bench.hosts_site(None, tmp_path / "secret", 3, (20.0, 1000.0), links, cores=2)
    assert site.contenders == ("1-worker", "allreduce@20", "allreduce@1000", "ps-sync@20", "ps-sync@1000")
    slow = site.clusters["allreduce@20"]
    assert (slow.gpus_per_node, slow.inter_node_bandwidth, slow.inter_node_latency) == (1, 2.4e6, 2e-4)
    assert site.labels["ps-sync@1000"] == "2 workers ps-sync on hosts @ 1 Gbit/s"
    assert "20 Mbit/s: 2.40 MB/s" in site.network
    two = bench.hosts_site(None, tmp_path / "secret", 2, (20.0,), links, cores=2)
    assert two.contenders == ("1-worker", "allreduce@20")
    # ResNet-20-like: 0.2 s of compute, 1.1 MB of gradients; at 2.4 MB/s the capped link, not the compute, sets
    # the pace, at 1 Gbit/s it hardly shows
    resnet = {**SUMMARY, "step_breakdown": {**SUMMARY["step_breakdown"], "forward_backward": 0.2, "total": 0.22},
              "scaling": {**SUMMARY["scaling"], "parameter_bytes": 1.1e6, "gradient_bytes": 1.1e6}}
    points = bench.predict_site(resnet, site.clusters)
    assert points["allreduce@20"].bound == "communication" and points["allreduce@1000"].bound == "compute"
    assert points["allreduce@20"].samples_per_second < 0.8 * points["allreduce@1000"].samples_per_second
    assert points["ps-sync@20"].samples_per_second < points["allreduce@20"].samples_per_second


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.serial  # measures transfers over capped namespace links against its model, in a 120 s bound
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_quick_run_on_namespace_hosts_writes_the_hosts_block(bench, tmp_path):
    argv = ["--part", "measured", "--hosts", "2", "--quick", "--caps", "20", "--steps", "4", "--batch-size",
            "16", "--timeout", "90", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "scaling_model-latest.json").read_text())
    block = report["hosts"]
    assert report["measured"] is None and block["caps_mbit"] == ["20"] and not report["errors"]
    row = block["by_cap"]["20"]["allreduce"]
    assert row["predicted_samples_per_second"] > 0 and row["measured_samples_per_second"] > 0, row
    assert 1e6 < block["links"]["20"]["bus_bandwidth"] < 4e6 and 0 < block["links"]["20"]["latency"] < 0.1  # 2.5 MB/s
    assert [g["name"].split(":")[0] for g in report["goals"]] == ["measured 2 workers allreduce on hosts @ 20 Mbit/s"]


def test_rounds_on_a_site_predict_each_job_from_the_rounds_one_worker_run(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "measure_compute_share", lambda timeout, seconds: {"speed": 0.5, "alone_ms": 1.0,
                                                                                  "together_ms": 2.0})
    monkeypatch.setattr(bench, "cpu_pressure", lambda: 0.1)
    links = {"20": {"bus_bandwidth": 2.4e6, "latency": 2e-4, "cap_mbit": 20.0}}
    site = bench.hosts_site(None, tmp_path / "secret", 2, (20.0,), links, cores=2)
    ran = []

    def run(contender, settings, out_dir, timeout):
        ran.append(contender)
        if contender == "1-worker":
            return dict(SUMMARY)
        return {**SUMMARY, "world_size": 2, "samples_per_second": 90.0,
                "step_breakdown": {**SUMMARY["step_breakdown"], "total": 1.28}}

    site = bench.Site(site.contenders, run, site.clusters, site.labels, site.network)
    res = bench.run_rounds({"steps": 4, "batch_size": 64, "probe_seconds": 0.1}, 2, 10.0, site)
    assert ran == ["1-worker", "allreduce@20", "allreduce@20", "1-worker"]  # odd rounds reversed
    d = bench.derive_measured(res)
    assert d["median_step_rate"]["allreduce@20"] == pytest.approx(128 / 1.28) and d["quiet_rounds"] == [True, True]
    # each round's prediction at the round's compute speed (0.5: 2 s of compute a step), not the nominal 1
    assert d["allreduce@20_predicted"] < 0.6 * d["allreduce@20_predicted_nominal"]
    assert d["allreduce@20_error"] == pytest.approx(abs(d["allreduce@20_predicted"] / (128 / 1.28) - 1))
    assert d["allreduce@20_bound_per_round"] == ["compute", "compute"]
    table = bench.format_measured(d, site, {"steps": 4, "batch_size": 64}, 2)
    assert "2 workers allreduce on hosts @ 20 Mbit/s" in table and "20 Mbit/s: 2.40 MB/s" in table
    goal = bench.goals([], d, site.labels)[0]
    assert goal["name"].startswith("measured 2 workers allreduce on hosts @ 20 Mbit/s") and goal["value"] > 0
