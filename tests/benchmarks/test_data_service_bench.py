"""benchmarks/data_service.py: its arguments, core map, memory bound, verdicts and a tiny real run on
namespace hosts (skipped where they cannot be made, like the other hosts tests)."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest

BENCHMARK = "data_service"


def test_arguments_cores_and_link(bench):
    args = bench.parse_args(["--cores", "0,1,2,3"])
    assert (args.cores, args.link_mbit, args.images, args.repeats, args.seconds) == ((0, 1, 2, 3), 1000.0, 256, 2, 10.0)
    quick = bench.parse_args(["--quick", "--link-mbit", "none", "--cores", "0,1,1,0"])
    assert (quick.link_mbit, quick.images, quick.repeats, quick.seconds) == (None, 64, 1, 4.0)
    for bad in ("0,1,2", "a,b,c,d", "0,1,2,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_cores(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_link("-5")
    assert bench.default_cores(2) == (0, 1, 0, 1) and bench.default_cores(8) == (0, 1, 2, 3)
    assert bench.shared_cores((0, 1, 2, 3)) == []
    assert bench.shared_cores((0, 1, 0, 1)) == ["core 0: trainer + worker 2", "core 1: worker 1 + worker 3"]


def test_memory_bound_follows_the_queue_sizes(bench):
    element = 16 * 3 * 224 * 224 * 4
    one, three = bench.memory_bound_kib(element), bench.memory_bound_kib(element, workers=3)
    held = bench.OPTIONS["buffer"] + bench.OPTIONS["max_outstanding"] * bench.OPTIONS["per_request"]
    assert one["trainer"] * 1024 == 3 * held * element + 64 * bench.MIB
    assert three["trainer"] - one["trainer"] == 3 * 2 * bench.OPTIONS["max_outstanding"] * element // 1024
    assert one["dispatcher"] == three["dispatcher"] == 32 * 1024


def _res(singles, services, bytes_per_s, tf=()):
    samples = {"local": [50.0], **{f"single-w{i}": [r] for i, r in enumerate(singles, 1)},
               **{f"service-k{k}": [r] for k, r in enumerate(services, 1)},
               **{f"tf-k{k}": [r] for k, r in enumerate(tf, 1)}, "memory": [1.0]}
    runs = {name: [{"bytes_per_s": bytes_per_s}] for name in samples}
    runs["memory"] = [{"within_bound": True}]
    return {"samples": samples, "runs": runs}


def test_verdict_is_the_workers_or_the_link(bench):
    args = bench.parse_args(["--link-mbit", "1000"])
    d = bench.derive(_res([40, 40, 40], [39, 76, 100], 30e6), args)
    assert [d["service"][f"service-k{k}"]["limit"] for k in (1, 2, 3)] == ["workers"] * 3
    assert d["service"]["service-k2"]["vs_sum"] == pytest.approx(0.95)
    assert not d["scaling_pass"]  # 100 < 0.9 x 120 and the link is at a quarter of its cap
    linked = bench.derive(_res([40, 40, 40], [39, 76, 100], 120e6), args)  # 0.96 x 125 MB/s
    assert linked["service"]["service-k3"]["limit"] == "link" and linked["scaling_pass"]
    uncapped = bench.derive(_res([40, 40, 40], [39, 76, 100], 120e6), bench.parse_args(["--link-mbit", "none"]))
    assert math.isnan(uncapped["service"]["service-k3"]["link_share"]) and not uncapped["scaling_pass"]


def test_tf_rows_are_skipped_with_the_reason_without_tensorflow(bench, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorflow" else real(name, *a))
    assert bench.tfds.skip_reason() == bench.tfds.TF_SKIP
    args = bench.parse_args(["--link-mbit", "1000"])
    assert bench.tf_skip(args) == bench.tfds.TF_SKIP
    assert not any(n.startswith("tf-") for n in bench.contenders(3, tf=bench.tf_skip(args) is None))
    d = bench.derive(_res([40, 40, 40], [39, 76, 100], 30e6), args)
    assert d["tf"] == {"rows": {}, "min_ratio": d["tf"]["min_ratio"], "skipped": bench.tfds.TF_SKIP}
    table = bench.format_table(_res([40, 40, 40], [39, 76, 100], 30e6), {**d, "memory": None}, args, "up")
    assert re.search(r"\ntf-data-service +skipped: " + re.escape(bench.tfds.TF_SKIP), table), table
    goals = bench.goal_rows(d)
    assert [g["name"] for g in goals] == [bench.GOAL_SCALING.name, bench.GOAL_MEMORY.name]
    assert f"SKIP {bench.GOAL_TF.name}: {bench.tfds.TF_SKIP}" in bench.goal_lines(goals, d)
    assert bench.tf_skip(bench.parse_args(["--no-tf"])) == "left out (--no-tf)"


def test_tf_rows_give_conveyor_over_tf_per_worker_count(bench, monkeypatch):
    monkeypatch.setattr(bench.tfds, "skip_reason", lambda: None)
    args = bench.parse_args(["--link-mbit", "1000"])
    assert bench.contenders(3, tf=True)[-4:] == ["tf-k1", "tf-k2", "tf-k3", "memory"]
    res = _res([40, 40, 40], [39, 76, 100], 30e6, tf=[30, 80, 100])
    d = bench.derive(res, args)
    ratios = [d["tf"]["rows"][f"tf-k{k}"]["conveyor_vs_tf"] for k in (1, 2, 3)]
    assert ratios == pytest.approx([1.3, 0.95, 1.0]) and d["tf"]["min_ratio"] == pytest.approx(0.95)
    tf_goal = bench.goal_rows(d)[-1]
    assert tf_goal["name"] == bench.GOAL_TF.name and not tf_goal["pass"]
    assert "0.95x at the lowest K" in bench.goal_lines(bench.goal_rows(d), d)
    table = bench.format_table(res, {**d, "memory": None}, args, "up")
    assert "tf-k2 (tf.data service, workers 1..2)" in table and "skipped" not in table
    faster = bench.derive(_res([40, 40, 40], [39, 76, 100], 30e6, tf=[30, 70, 90]), args)
    assert bench.goal_rows(faster)[-1]["pass"]
    failed = bench.derive(_res([40, 40, 40], [39, 76, 100], 30e6, tf=[30, float("nan"), 90]), args)
    assert math.isnan(failed["tf"]["min_ratio"]) and not bench.goal_rows(failed)[-1]["pass"]


def test_a_loaded_machine_is_named_in_the_table(bench):
    quiet = _res([40, 40, 40], [39, 76, 100], 30e6)
    for runs in quiet["runs"].values():
        runs[0]["loadavg_1min"] = 1.5
    assert bench.loaded_note(quiet, cores=2) is None
    busy = _res([40, 40, 40], [39, 76, 100], 30e6)
    busy["runs"]["local"][0]["loadavg_1min"] = 26.3
    busy["samples"]["single-w2"] = [43.0, 184.6]  # #23's run: the same contender 4.3x apart between rounds
    busy["samples"]["service-k1"] = [22.7, float("nan")]  # a failed round says nothing about the spread
    note = bench.loaded_note(busy, cores=2)
    assert note.startswith("LOADED (1-min load average up to 26.3 on 2 cores; single-w2's rounds differ 4.3x)")
    table = bench.format_table(busy, {**bench.derive(busy, bench.parse_args([])), "memory": None},
                               bench.parse_args([]), "up")
    assert "\nLOADED (" in table and "single-w2's rounds differ 4.3x)" in table  # whatever this machine's cores


def test_refuses_without_namespaces(bench, monkeypatch):
    import conveyor.testing.hosts

    monkeypatch.setattr(conveyor.testing.hosts, "unavailable", lambda: "network namespaces need root")
    assert bench.main(["--quick"]) == 2


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_tiny_run_on_namespace_hosts(bench, tmp_path):
    from conveyor.testing.hosts import unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    assert bench.main(["--quick", "--images", "16", "--batch", "4", "--warmup", "1", "--seconds", "1", "--no-tf",
                       "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "data_service-latest.json").read_text())
    assert report["errors"] == [], report["errors"]
    assert all(report["samples"][f"single-w{i}"][0] > 0 for i in (1, 2, 3))
    assert report["derived"]["memory"]["within_bound"]
    assert re.search(r"tf-data-service +skipped: left out \(--no-tf\)", report["table"])
    assert "uptime:" in report["table"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_tiny_tf_data_service_run_on_namespace_hosts(bench, tmp_path):
    """TensorFlow's dispatcher, one worker and its trainer on namespace hosts: a positive rate."""
    from conveyor.testing.hosts import Hosts, unavailable

    why = unavailable() or bench.tfds.skip_reason()
    if why:
        pytest.skip(why)
    args = bench.parse_args(["--quick", "--images", "16", "--batch", "4", "--warmup", "1", "--seconds", "1"])
    with Hosts(5, rate_mbit=args.link_mbit, names=["trainer", "worker1", "worker2", "worker3", "dispatcher"]) as hosts:
        b = bench.Bench(hosts, tmp_path, bench.make_data(tmp_path, args.images), args)
        rate, run = bench.measure(b, "tf-k1", {})
    assert rate > 0 and run["images"] > 0 and run["bytes_per_s"] > 0
    assert run["tensorflow"] and run["compression"] == "none"
