"""Smoke test of benchmarks/data_state.py: a tiny run writes a sane JSON with both contenders.

Not a performance assertion, except the one the design guarantees at any size: the provenance state is
much smaller than the element state, and both resume to the same batch.
"""

from __future__ import annotations

import json

import pytest

from numbers_check import finite_positive

BENCHMARK = "data_state"


def test_parse_args(bench):
    args = bench.parse_args([])
    assert (args.records, args.buffer, args.repeats, args.image_size) == (24_000, 10_000, 5, 64)
    quick = bench.parse_args(["--quick"])
    assert (quick.records, quick.buffer, quick.repeats) == (1_200, 500, 1)
    for bad in (["--buffer", "0"], ["--records", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_tiny_run_writes_json(bench, tmp_path, capsys):
    argv = ["--quick", "--records", "300", "--buffer", "200", "--throughput-records", "200", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "data_state-latest.json").read_text())
    assert report["benchmark"] == "data_state" and report["errors"] == []
    assert sorted(report["config"]["order"]) == sorted(bench.CONTENDERS)
    d = report["derived"]
    assert d["resumed_exactly"] is True
    for key in bench.KEYS:
        for c in bench.CONTENDERS:
            assert finite_positive(d["median"][key][c])
    assert d["median"]["state_bytes"]["provenance"] * 10 < d["median"]["state_bytes"]["elements"]
    assert [g["name"] for g in report["goals"]] == [g.name for g in bench.GOALS]
    assert report["table"] in printed and "state KB" in printed
