"""Smoke test of benchmarks/ps.py: `--quick` runs every contender's real processes and writes a sane JSON.

Not a performance assertion: rates are only checked to be positive and finite, ratios to be finite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from numbers_check import finite_positive

ROOT = Path(__file__).resolve().parents[2]


BENCHMARK = "ps"


def test_parse_args(bench):
    args = bench.parse_args([])
    assert (args.mb, args.repeats, args.iters, args.tensors) == (100.0, 5, 3, 25)
    quick = bench.parse_args(["--quick"])
    assert (quick.mb, quick.repeats) == (16.0, 1)
    assert bench.parse_args(["--quick", "--repeats", "2"]).repeats == 2
    for bad in (["--mb", "0"], ["--iters", "0"], ["--tensors", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.multiprocess
@pytest.mark.serial  # a quick benchmark run: each round has a 25-50 s bound that a test on the other core can break
def test_quick_run_writes_json(bench, tmp_path, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path), "--timeout", "25"]) == 0
    printed = capsys.readouterr().out
    latest = tmp_path / "ps-latest.json"
    stamped = [p for p in tmp_path.glob("ps-*.json") if p.name != "ps-latest.json"]
    assert latest.exists() and len(stamped) == 1 and stamped[0].read_text() == latest.read_text()
    report = json.loads(latest.read_text())

    assert report["benchmark"] == "ps" and report["errors"] == []
    assert report["machine"]["cores"] >= 1 and "conveyor" in report["machine"]
    config = report["config"]
    assert config["quick"] is True and config["repeats"] == 1 and config["ps_tasks"] == 2
    assert 15e6 <= config["bytes"] <= 16e6 and config["bytes"] % (4 * config["tensors"]) == 0
    assert sorted(config["order"]) == sorted(bench.CONTENDERS)

    for c in bench.CONTENDERS:
        assert len(report["samples"][c]) == 1 and finite_positive(report["samples"][c][0])
        assert finite_positive(report["derived"]["median_gbps"][c])
        run = report["runs"][c][0]
        assert run["bytes"] == config["bytes"] and len(run["times_s"]) == config["iters"]
    assert report["runs"]["conveyor_ps"][0]["roundtrip_ok"] is True
    assert report["runs"]["raw_tcp"][0]["roundtrip_ok"] is True
    assert report["derived"]["roundtrip_ok"] is True

    d = report["derived"]
    assert finite_positive(d["conveyor_vs_gloo_busbw"]) and finite_positive(d["conveyor_vs_raw_tcp"])
    assert [g["threshold"] for g in report["goals"]] == [1.0, 0.5]
    assert report["all_pass"] == all(g["pass"] for g in report["goals"])
    for g in report["goals"]:
        assert g["pass"] == (g["value"] >= g["threshold"])
        assert ("PASS " if g["pass"] else "FAIL ") + g["name"] in printed
    assert "conveyor_ps / gloo busbw" in printed and "conveyor_ps / raw TCP" in printed
    assert report["table"] in printed
