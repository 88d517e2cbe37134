"""The exactly-once section of benchmarks/elastic.py, short: its counting on made-up logs, and one real round of
the digits job over 2 -> 1 -> 2 workers (1 epoch) that must skip and repeat no record."""

from __future__ import annotations

import json

import pytest

BENCHMARK = "elastic_exactly_once"


def test_undone_steps_do_not_count_and_every_skip_and_repeat_does(bench):
    steps = [{"run": "a", "epoch": 0, "step": 1, "ids": [0, 1]}, {"run": "a", "epoch": 0, "step": 2, "ids": [2, 3]},
             {"run": "a", "epoch": 0, "step": 3, "ids": [4, 5]},  # undone: run b resumed from step 2
             {"run": "b", "epoch": 0, "step": 3, "ids": [4, 5]}, {"run": "b", "epoch": 0, "step": 4, "ids": [6]}]
    kept, undone = bench.applied(steps, ["a", "b"])
    assert undone == 1 and [s["step"] for s in kept] == [1, 2, 3, 4]
    assert bench.tally(kept, list(range(7)), 1) == [{"skipped": 0, "repeated": 0}]
    wrong = kept + [{"run": "b", "epoch": 0, "step": 5, "ids": [6, 99]}]
    assert bench.tally(wrong, list(range(8)), 2) == [{"skipped": 1, "repeated": 2}, {"skipped": 8, "repeated": 0}]


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_one_short_round_skips_and_repeats_nothing(bench, tmp_path, capsys):
    pytest.importorskip("sklearn")
    argv = ["--quick", "--worlds", "2,1,2", "--out", str(tmp_path), "--dir", str(tmp_path)]
    assert bench.main(argv) == 0
    report = json.loads((tmp_path / "elastic-exactly-once-latest.json").read_text())
    section = report["sections"]["exactly-once"]
    assert section["errors"] == [], section["errors"]
    (run,) = section["runs"]
    assert (run["skipped"], run["repeated"]) == (0, 0), run["per_epoch"]
    assert run["changes_in_epoch_0"] == 2 and run["steps_undone"] > 0 and run["announced"] == 2
    assert 0.5 < run["disturbed_accuracy"] <= 1 and 0.5 < run["undisturbed_accuracy"] <= 1
    assert run["undisturbed_per_epoch"] == [{"skipped": 0, "repeated": 0}]
    assert section["table"] in capsys.readouterr().out
    assert [g["name"] for g in report["goals"]] == [g.name for g in bench.GOALS]
