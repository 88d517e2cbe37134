"""Smoke test of benchmarks/elastic.py: a tiny async-save section writes a sane table and JSON.

Not a performance assertion: times are only checked to be positive and finite, and the asynchronous
save's blocked time to be at most its total.
"""

from __future__ import annotations

import json

import pytest
import torch

from numbers_check import finite_positive

BENCHMARK = "elastic"


def test_parse_args(bench):
    args = bench.parse_args([])
    assert (args.repeats, args.width, args.layers, args.threads) == (5, 2048, 3, 1)
    assert args.section == ["async-save", "stall", "goodput", "exactly-once"] == list(bench.SECTIONS)
    quick = bench.parse_args(["--quick", "--section", "async-save"])
    assert (quick.repeats, quick.width, quick.layers) == (1, 256, 2)
    for bad in (["--section", "goodput-someday"], ["--width", "0"], ["--repeats", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_the_default_state_is_at_least_100_mb(bench):
    model, opt = bench.make_mlp(64, 3)
    width, layers = bench.parse_args([]).width, bench.parse_args([]).layers
    per_param = bench.state_bytes(model, opt) / sum(p.numel() for p in model.parameters())
    assert per_param >= 12  # the weights and Adam's two moments, 4 bytes each
    assert layers * (width * width + width) * 12 >= 100e6


def test_tiny_run_writes_json(bench, tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        argv = ["--quick", "--section", "async-save", "--width", "32", "--repeats", "2", "--out", str(tmp_path),
                "--dir", str(tmp_path)]
        assert bench.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "elastic-latest.json").read_text())
    assert report["benchmark"] == "elastic" and report["errors"] == [] and list(report["sections"]) == ["async-save"]
    section = report["sections"]["async-save"]
    assert sorted(section["config"]["order"]) == ["async", "async", "sync", "sync"]
    d = section["derived"]
    for key in ("state_mb", "sync_save_s", "async_blocked_s", "async_total_s", "blocked_ratio"):
        assert finite_positive(d[key]), key
    for run in section["runs"]["async"]:
        assert 0 < run["blocked_s"] <= run["total_s"]
    assert [g["name"] for g in report["goals"]] == [g.name for g in bench.SAVE_GOALS]
    assert section["table"] in printed and "async blocked / sync save" in printed
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("conveyor-elastic")] == []  # removed after
