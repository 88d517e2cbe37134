"""Smoke test of benchmarks/pipeline.py: every piece runs on a tiny workload and the report is sane.

Not a performance assertion: rates are only checked to be positive and finite.
"""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conveyor.data import encode_example

ROOT = Path(__file__).resolve().parents[2]
CONTENDERS = ("single_thread", "parallel_plain", "sequential", "parallel", "dataloader")


BENCHMARK = "pipeline"


def tiny(bench, **kw):
    args = dict(num_images=300, num_shards=2, image_size=32, crop=32, batch_size=32, fn=bench.cifar_fn,
                records=96, memory_shards=1, seed=7)
    args.update(kw)
    return bench.Workload("tiny", **args)


def test_generation_is_deterministic_and_cached(bench, tmp_path):
    wl = tiny(bench)
    files, manifest = bench.generate_workload(wl, tmp_path / "a", progress=False)
    assert [Path(f).name for f in files] == ["train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord"]
    assert [s["records"] for s in manifest["shards"]] == [150, 150]
    assert manifest["params"]["generator_version"] == bench.GENERATOR_VERSION
    mtimes = [Path(f).stat().st_mtime_ns for f in files]

    again, _ = bench.generate_workload(wl, tmp_path / "a", progress=False)  # cached: not rewritten
    assert again == files and [Path(f).stat().st_mtime_ns for f in again] == mtimes

    other, _ = bench.generate_workload(wl, tmp_path / "b", progress=False)  # same seed: same bytes
    assert [Path(f).read_bytes() for f in other] == [Path(f).read_bytes() for f in files]

    (Path(files[0]).parent / "manifest.json").write_text("{}")  # a stale manifest regenerates
    files2, _ = bench.generate_workload(wl, tmp_path / "a", progress=False)
    assert [Path(f).read_bytes() for f in files2] == [Path(f).read_bytes() for f in other]


def test_images_are_not_flat(bench):
    images = bench.make_images(np.random.default_rng(0), 4, 32)
    assert images.dtype == np.uint8 and images.shape == (4, 32, 32, 3)
    assert all(img.std() > 10 for img in images)


@pytest.mark.parametrize("size, crop, fn", [(32, 32, "cifar_fn"), (256, 224, "chexnet_fn")])
def test_per_record_function(bench, size, crop, fn):
    image = bench.make_images(np.random.default_rng(1), 1, size)[0]
    buf = io.BytesIO()
    Image.fromarray(image, "RGB").save(buf, format="JPEG", quality=90)
    record = encode_example({"image": buf.getvalue(), "label": 3})
    x, y = getattr(bench, fn)(record)
    assert x.shape == (3, crop, crop) and x.dtype == np.float32 and x.flags.c_contiguous
    assert np.isfinite(x).all() and -5 < x.mean() < 5 and x.std() > 0.05
    assert type(y) is np.int64 and y == 3


def test_parse_args_quick(bench):
    args = bench.parse_args(["--quick"])
    assert args.workloads == ["cifar"] and args.repeats == 1
    args = bench.parse_args(["--workloads", "chexnet,cifar", "--records", "100", "--repeats", "2"])
    assert args.workloads == ["chexnet", "cifar"] and args.records == 100 and args.repeats == 2
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "imagenet"])


@pytest.mark.multiprocess
def test_run_workload_and_report(bench, tmp_path):
    wl = tiny(bench)
    lines: list[str] = []
    settings = bench.RunSettings(n_records=96, repeats=2, warmup_batches=1, idle_batches=4, memory_epochs=5,
                                 with_tfdata=False, progress=False)
    res = bench.run_workload(wl, tmp_path / "data", settings, log=lines.append)
    assert any("round 2/2" in line for line in lines)

    for c in CONTENDERS:
        assert len(res["samples"][c]) == 2
        assert all(math.isfinite(r) and r > 0 for r in res["samples"][c])
        assert res["min"][c] <= res["median"][c] <= res["max"][c]
    assert "tfdata" not in res["samples"]
    d = res["derived"]
    assert d["cores"] >= 1
    assert d["limit"] == pytest.approx(d["cores"] * res["median"]["single_thread"])
    assert d["parallel_vs_dataloader"] == pytest.approx(res["median"]["parallel"] / res["median"]["dataloader"])
    assert d["tfdata_vs_parallel"] is None

    idle = res["idle"]
    assert idle["batches"] == 4 and 0 <= idle["idle_fraction"] <= 1
    assert idle["sleep_s"] == pytest.approx(0.8 * idle["batch_time_s"])  # calibrated in the same run
    assert idle["reference_batch_time_s"] == pytest.approx(wl.batch_size / res["median"]["parallel"])

    mem = res["memory"]
    assert mem["records_per_epoch"] == 150 and len(mem["peak_mb_per_epoch"]) == 5
    assert all(p > 10 for p in mem["peak_mb_per_epoch"]) and isinstance(mem["grows"], bool)

    results = {wl.name: res}
    report = bench.build_report(results, {"test": True})
    table = report["table"]
    for c in (*CONTENDERS, "limit (", "tfdata"):
        assert c in table
    assert "skipped (TensorFlow not installed)" in table
    goals = report["goals"]
    assert len(goals) == 4 and all(isinstance(g["pass"], bool) for g in goals)
    goal_lines = bench.format_goals(goals).splitlines()
    assert len(goal_lines) == 4 and all(g.startswith(("PASS ", "FAIL ")) for g in goal_lines)
    assert "tiny" in bench.format_details(results)

    path = bench.write_json(report, tmp_path / "out")
    for p in (path, tmp_path / "out" / "pipeline-latest.json"):
        data = json.loads(p.read_text())
        assert data["machine"]["cores"] == d["cores"] and data["machine"]["torch"]
        assert data["results"]["tiny"]["samples"]["parallel"] == res["samples"]["parallel"]
        assert data["results"]["tiny"]["workload"]["fn"] == "cifar_fn"
        assert data["all_pass"] == all(g["pass"] for g in goals)


def test_guard_stops_a_runaway_measurement(bench):
    with pytest.raises(bench.GuardTripped, match="time limit"):
        with bench.Guard("sleepy", max_rss=None, timeout=0.3, interval=0.05):
            time.sleep(30)
    with pytest.raises(bench.GuardTripped, match="memory"):
        with bench.Guard("greedy", max_rss=1, timeout=None, interval=0.05):
            time.sleep(30)
    with bench.Guard("calm", max_rss=None, timeout=30, interval=0.05):  # no trip, no stray signal later
        time.sleep(0.1)
    time.sleep(0.2)


def broken_fn(record):
    raise ValueError("no such image")


@pytest.mark.multiprocess
def test_failing_contenders_are_reported_not_fatal(bench, tmp_path):
    wl = tiny(bench, fn=broken_fn, num_images=64)
    lines: list[str] = []
    settings = bench.RunSettings(n_records=32, repeats=1, warmup_batches=1, memory_epochs=1, with_tfdata=False,
                                 progress=False)
    res = bench.run_workload(wl, tmp_path / "data", settings, log=lines.append)
    assert all(math.isnan(v[0]) for v in res["samples"].values())
    assert len(res["errors"]) == len(CONTENDERS) + 1  # every contender, and the memory run
    assert all("no such image" in e for e in res["errors"])
    assert res["idle"] is None and "error" in res["memory"]
    report = bench.build_report({wl.name: res}, {})
    assert "FAILED" in report["table"] and not report["all_pass"]
    assert "not measured" in bench.format_goals(report["goals"])
    assert "ERROR" in bench.format_details({wl.name: res})
    data = json.loads(bench.write_json(report, tmp_path / "out").read_text())  # strict JSON: null, not NaN
    assert data["results"]["tiny"]["samples"]["parallel"] == [None]
