"""Smoke test of benchmarks/case_study.py: the three parts' logic on known numbers, and `--quick` runs of the
real worker processes and `conveyor run` jobs that write the JSON and the plots.

Not a performance assertion: measured rates are only checked to be positive and finite. The strategies table
is checked against reports built by the real benchmarks' own `derive` functions, so a change in what those
benchmarks write shows up here.
"""

from __future__ import annotations

import json
import math
import zlib

import pytest

from conveyor.data import FixedLenFeature, parse_single_example
from numbers_check import finite_positive

BENCHMARK = "case_study"
PNG = b"\x89PNG\r\n\x1a\n"


def test_parse_args(bench):
    args = bench.parse_args([])
    cores = bench.cpu_cores()
    assert args.workers == bench.worker_counts(bench.default_workers(cores)) and args.parts == bench.PARTS
    assert (args.repeats, args.batch, args.batches) == (3, 128, 100)
    assert (args.steps, args.model_batch, args.depth) == (20, 64, 20)
    assert args.out == bench.DEFAULT_OUT and args.data == bench.DEFAULT_OUT / "data" and args.run_missing
    assert args.shards == max(16, max(args.workers))
    quick = bench.parse_args(["--quick", "--workers", "2,1,2"])
    assert quick.workers == (1, 2) and (quick.repeats, quick.batch, quick.steps, quick.depth) == (1, 32, 3, 8)
    assert bench.parse_args(["--parts", "strategies,input"]).parts == ("input", "strategies")
    for bad in (["--workers", "0,1"], ["--workers", "x"], ["--parts", "nope"], ["--depth", "9"],
                ["--workers", "1,2", "--shards", "1"], ["--compute-ms", "-1"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_default_workers_double_up_to_the_cores(bench):
    assert [bench.default_workers(n) for n in (1, 2, 6, 16)] == ["1", "1,2", "1,2,4,6", "1,2,4,8,16"]


# ------------------------------------------------------------------------------------ part 1


def _ids(record: bytes):
    """A record's identity (the CRC of its PNG) where a training map would decode it."""
    ex = parse_single_example(record, {"image": FixedLenFeature([], "string"), "label": FixedLenFeature([], "int64")})
    assert ex["image"].startswith(PNG)
    return zlib.crc32(ex["image"])


def test_contenders_split_the_records_and_only_old_decodes_them_all(bench, tmp_path):
    inp = bench.inp
    data = inp.prepare_data(tmp_path, 40, 4)
    assert len(data["files"]) == 5 and data["one_file"].endswith("train-00000-of-00001.tfrecord")
    assert inp.prepare_data(tmp_path, 40, 4) == data  # cached: the manifest matches
    calls = {"n": 0}

    def counted(record: bytes):
        calls["n"] += 1
        return _ids(record)

    config = {**data, "batch": 1, "shuffle": 8, "epochs": 1}
    seen = {}
    for contender in inp.CONTENDERS:
        ranks = []
        for rank in (0, 1):
            calls["n"] = 0
            parse = counted if contender != "new" else _ids  # new's map runs in forked processes
            it = iter(inp.build_pipeline(contender, {**config, "world": 2, "rank": rank}, parse))
            try:
                ranks.append([int(x[0]) for x in it])
            finally:
                it.close()
            if contender == "old":
                assert calls["n"] == 40  # every record decoded, half kept
            elif contender == "old_sharded":
                assert calls["n"] == 20
        assert len(ranks[0]) == len(ranks[1]) == 20 and not set(ranks[0]) & set(ranks[1])
        seen[contender] = set(ranks[0]) | set(ranks[1])
    assert seen["old"] == seen["old_sharded"] == seen["new"] and len(seen["new"]) == 40


def _input_settings():
    return {"batch": 100, "compute_ms": 100.0, "calibration": {"seconds_per_batch": 0.1}, "train_images": 1000,
            "shards": 4, "batches": 10, "warmup": 2}


def _input_run(rate: float, idle: float) -> dict:
    return {"samples_per_second": rate, "accelerator_idle_fraction": idle, "cores_used": 1.0, "other_cores": 0.1}


def test_input_derive_table_and_plot(bench, tmp_path):
    inp = bench.inp
    samples = {"old@1": [900.0, 1000.0], "old@2": [1000.0, 900.0], "new@1": [1000.0, 1000.0],
               "new@2": [1800.0, 2000.0]}
    res = {"samples": samples, "runs": {k: [_input_run(x, 0.5) for x in v] for k, v in samples.items()}}
    d = inp.derive(res, ("old", "new"), (1, 2), _input_settings(), cores=2)
    assert d["samples_per_second"]["new"]["2"] == 1900.0
    assert d["speedup"]["old"]["2"] == pytest.approx((1000 / 900 + 0.9) / 2)
    assert d["efficiency"]["new"]["2"] == pytest.approx(0.95) and d["efficiency"]["new"]["1"] == 1.0
    assert d["new_vs"]["old"]["2"] == pytest.approx((1.8 + 2000 / 900) / 2)
    assert d["bounds"]["accelerator"] == {"1": 1000.0, "2": 2000.0} and d["bounds"]["all_cores_decoding"] == 2000.0
    assert d["accelerator_idle_fraction"]["old"]["1"] == 0.5 and d["other_cores_overall"] == 0.1
    table = inp.format_table(res, d, ("old", "new"), (1, 2), _input_settings(), 2)
    assert "new / old" in table and "1800 2000" in table and "accelerator" in table
    pytest.importorskip("matplotlib")
    path = bench.plots.plot_input_scaling(d, ("old", "new"), (1, 2), tmp_path / "in.png", "title")
    assert path.read_bytes().startswith(PNG)


# ------------------------------------------------------------------------------------ part 2


def test_allreduce_derive_table_and_plot(bench, tmp_path):
    scaling = bench.scaling
    samples = {"1": [10.0, 12.0], "2": [18.0, 20.0], "4": [30.0, math.nan]}
    runs = {k: [None if math.isnan(x) else {"median_step_seconds": 1.0, "other_cores": 0.5} for x in v]
            for k, v in samples.items()}
    res = {"samples": samples, "runs": runs, "order": ["1", "2", "4"] * 2}
    d = scaling.derive(res, (1, 2, 4))
    assert d["speedup"]["2"] == pytest.approx((1.8 + 20 / 12) / 2) and d["speedup"]["4"] == 3.0
    assert d["efficiency"]["4"] == 0.75 and d["reference_speedup"] == {"2": 1.7, "4": 3.5, "8": 6.2}
    assert d["other_cores"]["1"] == 0.5
    table = scaling.format_table(res, d, {"depth": 20, "batch": 64, "steps": 20, "cores_per_worker": 1}, (1, 2, 4))
    assert "(reference only)" in table and "reference" in table.splitlines()[-1]
    cmd = scaling.job_command(2, {"batch": 64, "steps": 20, "depth": 20, "timeout": 300}, tmp_path / "o", tmp_path)
    assert cmd[cmd.index("-n") + 1] == "2" and cmd[cmd.index("--strategy") + 1] == "allreduce"
    assert "--synthetic" in cmd and cmd[cmd.index("--max-steps") + 1] == "20"
    assert scaling.job_cpus(10 ** 6, 1) is None
    pytest.importorskip("matplotlib")
    path = bench.plots.plot_allreduce_scaling(d, (1, 2, 4), tmp_path / "ar.png", "t", scaling.REFERENCE, "ref")
    assert path.read_bytes().startswith(PNG)


# ------------------------------------------------------------------------------------ part 3


def write_sources(folder, other_benchmark):
    """What ps_training.py and ps.py would write (allreduce.py left out), derived values made by their own code."""
    folder.mkdir(parents=True, exist_ok=True)
    with other_benchmark("ps_training") as pst:
        sps = {"allreduce": 400.0, "ps-sync": 300.0, "ps-async": 350.0, "ps-sync+straggler": 150.0,
               "ps-async+straggler": 250.0}
        samples = {c: {"steps_per_second": [v / 64], "samples_per_second": [v], "wall_seconds": [1.0],
                       "eval_accuracy": [0.9]} for c, v in sps.items()}
        runs = {c: [{"steps": 10, "samples": 640}] for c in sps}
        d = pst.derive({"samples": samples, "runs": runs}, pst.CONTENDERS, 32)
        report = {"derived": d, "config": {"workers": 2, "ps_tasks": 1, "slowdown": 2.0, "repeats": 1}}
        (folder / "ps_training-latest.json").write_text(json.dumps(report))
    with other_benchmark("ps") as ps:
        samples = {"raw_tcp": [2.0], "gloo_allreduce": [1.0], "conveyor_ps": [1.5]}
        d = ps.derive({"samples": samples, "runs": {c: [{"roundtrip_ok": True}] for c in samples}})
        (folder / "ps-latest.json").write_text(json.dumps({"derived": d, "config": {"bytes": 16e6}}))
    return sps


def test_strategies_table_from_the_benchmarks_own_json(bench, tmp_path, other_benchmark):
    st = bench.strategies
    sps = write_sources(tmp_path, other_benchmark)
    sources = st.load_sources(tmp_path, run_missing=False, timeout=1)
    assert "error" in sources["allreduce"] and not sources["ps"]["ran_here"]
    rows, errors = st.assemble(sources)
    assert len(errors) == 1 and errors[0].startswith("allreduce:")
    by = {r["configuration"]: r for r in rows}
    assert by["ps-sync, 2 workers + 1 ps"]["ratio"] == 300 / 400
    assert by["ps-async, worker 1 2x slower"]["ratio"] == 250 / 350
    straggler = next(r for r in rows if r["configuration"].startswith("straggler"))
    assert straggler["ratio"] == pytest.approx(250 / 150) and straggler["accuracy"] == 0.0
    assert by["conveyor ps push + pull, 2 servers, 16 MB"]["ratio"] == 1.5
    table = st.format_table(rows, sources, errors)
    assert "missing: allreduce" in table and "ps-async, worker 1 2x slower" in table
    broken = {"allreduce": {"report": {"derived": {}}, "ran_here": False}}
    assert "lacks" in st.assemble(broken)[1][-1]
    assert sps["allreduce"] == by["allreduce, 2 workers"]["value"]


# ------------------------------------------------------------------------------------ real runs


def _report(folder):
    latest = folder / "case_study-latest.json"
    stamped = [p for p in folder.glob("case_study-*.json") if p != latest]
    assert latest.exists() and len(stamped) == 1 and stamped[0].read_text() == latest.read_text()
    return json.loads(latest.read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)  # a few seconds on a quiet machine; minutes where other jobs take both cores
def test_quick_input_and_strategies(bench, tmp_path, capsys, other_benchmark):
    pytest.importorskip("matplotlib")
    write_sources(tmp_path / "results", other_benchmark)
    out = tmp_path / "out"
    assert bench.main(["--quick", "--workers", "1,2", "--parts", "input,strategies", "--contenders", "old,new",
                       "--out", str(out), "--results", str(tmp_path / "results"), "--no-run-missing"]) == 0
    printed = capsys.readouterr().out
    report = _report(out)
    assert report["benchmark"] == "case_study" and report["allreduce_scaling"] is None
    assert report["config"]["quick"] and report["config"]["workers"] == [1, 2]
    part = report["input_pipeline"]
    assert part["errors"] == [] and sorted(part["order"]) == ["new@1", "new@2", "old@1", "old@2"]
    for name, values in part["samples"].items():
        assert len(values) == 1 and finite_positive(values[0]), name
        run = part["runs"][name][0]
        assert len(run["workers"]) == int(name.split("@")[1]) and 0 <= run["accelerator_idle_fraction"] <= 1
    assert finite_positive(part["config"]["compute_ms"]) and part["derived"]["speedup"]["new"]["1"] == 1.0
    assert part["table"] in printed and report["strategies"]["table"] in printed
    assert report["plots"] == {"input_pipeline": str(out / "input_scaling.png")}
    assert (out / "input_scaling.png").read_bytes().startswith(PNG)
    assert report["strategies"]["rows"] and report["errors"] == ["strategies: allreduce: " +
                                                                 report["strategies"]["errors"][0].split(": ", 1)[1]]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)  # one `conveyor run` job: torch imports dominate, slow on a loaded machine
def test_quick_allreduce_job(bench, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert bench.main(["--quick", "--workers", "1", "--parts", "allreduce", "--out", str(out)]) == 0
    report = _report(out)
    part = report["allreduce_scaling"]
    assert report["errors"] == [] and report["input_pipeline"] is None and report["strategies"] is None
    run = part["runs"]["1"][0]
    assert run["world_size"] == 1 and run["steps"] == 3 and finite_positive(run["median_step_seconds"])
    assert finite_positive(run["cores_used"]) and run["other_cores"] >= 0
    assert finite_positive(part["samples"]["1"][0]) and part["derived"]["speedup"]["1"] == 1.0
    assert part["reference"] == {"2": 1.7, "4": 3.5, "8": 6.2} and part["table"] in capsys.readouterr().out
    assert (out / "allreduce_scaling.png").read_bytes().startswith(PNG)


# ------------------------------------------------------------------------------------ part 4


def test_gpu_part_is_skipped_with_the_reason_without_cuda(bench, tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    assert bench.main(["--quick", "--parts", "gpu", "--out", str(out)]) == 0
    part = _report(out)["gpu_feeding"]
    assert part["skipped"].startswith("no CUDA device") and "--gpu-device cpu" in part["skipped"]
    assert part["errors"] == [] and "skipped" in capsys.readouterr().out


def test_gpu_derive_table_and_plot(bench, tmp_path):
    gpu = bench.gpu
    names = gpu.points(("cifar",), (1, 2))
    assert names == ["cifar/device@2", "cifar/conveyor@1", "cifar/dataloader@1", "cifar/conveyor@2",
                     "cifar/dataloader@2"]
    rates = {"cifar/device@2": [1000.0, 1000.0], "cifar/conveyor@1": [500.0, 600.0],
             "cifar/dataloader@1": [250.0, 300.0], "cifar/conveyor@2": [960.0, 980.0],
             "cifar/dataloader@2": [500.0, math.nan]}
    runs = {k: [None if math.isnan(x) else {"device_idle_fraction": 1 - x / 1000} for x in v] for k, v in rates.items()}
    d = gpu.derive({"samples": rates, "runs": runs}, ("cifar",), (1, 2), enough=0.95)["cifar"]
    assert d["ceiling_samples_per_second"] == 1000.0 and d["ceiling_idle_fraction"] == 0.0
    assert d["conveyor"]["of_ceiling"] == {"1": 0.55, "2": 0.97} and d["conveyor"]["cores_needed"] == 2
    assert d["dataloader"]["cores_needed"] is None and d["dataloader"]["samples_per_second"]["2"] == 500.0
    assert d["conveyor_vs_dataloader"] == {"1": 2.0, "2": pytest.approx(960 / 500)}
    assert d["conveyor"]["device_idle_fraction"]["1"] == pytest.approx(0.45)
    settings = {"device_name": "NVIDIA Test", "steps": 60, "warmup": 10,
                "workloads": {"cifar": {"model": "ResNet-20", "batch": 128, "size": 32}}}
    table = gpu.format_table({"cifar": d}, settings, (1, 2), 0.95)
    assert "conveyor 2, dataloader more than 2" in table and "NVIDIA Test" in table
    pytest.importorskip("matplotlib")
    path = bench.plots.plot_gpu_feeding({"cifar": d}, (1, 2), 0.95, tmp_path / "gpu.png", "t")
    assert path.read_bytes().startswith(PNG)


def test_gpu_resnet50_is_resnet50_sized(bench):
    model = bench.gpu.resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's resnet50, 1,000 classes


def test_gpu_dataloader_share_gives_every_worker_records(bench, tmp_path):
    from torch.utils.data import DataLoader

    from conveyor.data.records import TFRecordWriter
    files = []
    for f in range(2):
        files.append(str(tmp_path / f"f{f}.tfrecord"))
        with TFRecordWriter(files[-1]) as w:
            for i in range(6):
                w.write(bytes([f * 10 + i]))
    for share in (files, files[:1]):  # 2 workers: a file each; on one file, every other record each
        loader = DataLoader(bench.gpu.RecordShare(share, lambda r: r[0]), batch_size=None, num_workers=2)
        it = iter(loader)
        got = [int(next(it)) for _ in range(6 * len(share))]
        del it
        assert sorted(got) == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15][:6 * len(share)], len(share)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)  # three fresh processes importing torch, a few steps of a ResNet-20 on the CPU
def test_quick_gpu_part_on_the_cpu(bench, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert bench.main(["--quick", "--parts", "gpu", "--gpu-device", "cpu", "--gpu-workloads", "cifar",
                       "--out", str(out), "--data", str(tmp_path / "data")]) == 0
    report = _report(out)
    part = report["gpu_feeding"]
    assert report["errors"] == [] and part["config"]["device_name"] == "cpu (smoke run)"
    assert sorted(part["samples"]) == ["cifar/conveyor@1", "cifar/dataloader@1", "cifar/device@1"]
    for name, (run,) in part["runs"].items():
        assert finite_positive(run["samples_per_second"]) and 0 <= run["device_idle_fraction"] < 1, name
        assert run["busy_seconds"] <= run["wall_seconds"] and not run["amp"]
    assert part["derived"]["cifar"]["conveyor"]["of_ceiling"]["1"] > 0
    assert part["table"] in capsys.readouterr().out and (out / "gpu_feeding.png").read_bytes().startswith(PNG)
