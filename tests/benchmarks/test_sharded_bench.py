"""Smoke test of benchmarks/sharded.py: its pieces in this process, and `--quick` (conveyor and paired) end to end.

Not a performance assertion: the quick model is tiny, so the memory and speed goals are not judged here;
the run must measure every contender (peak RSS, steps/s, the paired ratios, the collectives timed).
"""

from __future__ import annotations

import json
import math

import pytest

BENCHMARK = "sharded"


def test_parse_args_sizes_the_model_from_its_gib(bench):
    args = bench.parse_args([])
    assert (args.size_gb, args.width, args.steps) == (1.0, 2048, 3)
    assert 0.99 < args.depth * (args.width ** 2 + args.width) * 4 / 2 ** 30 < 1.01
    quick = bench.parse_args(["--quick"])
    assert (quick.width, quick.depth, quick.steps) == (256, 4, 2)
    for bad in (["--size-gb", "0"], ["--steps", "0"], ["--contenders", "nope"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_rss_is_read_from_proc(bench):
    now, peak = bench.rss_bytes(), bench.rss_bytes("VmHWM")
    assert 0 < now <= peak


def test_derive_takes_the_largest_rank_and_the_paired_median(bench):
    def rank(peak):
        return {"peak_rss": peak, "seconds": [0.5, 0.5], "parts": {"parameters": peak}}

    memory = {"ddp": [rank(10), rank(12)], "conveyor": [rank(6), rank(5)], "bare_fsdp2": None}
    paired = [{"seconds": {"conveyor": [1.0, 2.0, 1.0], "bare": [1.0, 1.0, 0.9]}, "conveyor_comm_per_step": {}}]
    d = bench.derive(memory, paired)
    assert d["memory_ratio"] == pytest.approx(0.5) and math.isnan(d["memory_ratio_bare"])
    assert d["paired_median"] == pytest.approx(0.9) and d["steps_per_second"]["ddp"] == pytest.approx(2.0)
    assert d["parts_bytes"] == {"ddp": {"parameters": 12}, "conveyor": {"parameters": 6}}  # the largest rank's


def test_pipeline_fsdp_is_judged_by_its_largest_rank_of_four_against_ddp(bench):
    def rank(peak):
        return {"peak_rss": peak, "seconds": [0.25], "parts": {"parameters": peak}}

    d = bench.derive({"ddp": [rank(10), rank(12)], "pipeline_fsdp": [rank(3), rank(4), rank(3), rank(2)]}, None)
    assert d["memory_ratio_pipeline_fsdp"] == pytest.approx(4 / 12) and math.isnan(d["memory_ratio"])
    assert "pipeline x FSDP (4 processes) 0.333" in bench.table({}, d)
    assert bench.PROCESSES == {"pipeline_fsdp": 4}


def test_paired_ratios_pool_both_build_orders_and_an_aa_run_compares_by_position(bench):
    first = [{"sides": ["conveyor", "bare"], "seconds": {"conveyor": [2.0, 2.0], "bare": [1.0, 1.0]},
              "conveyor_comm_per_step": {}}]
    swapped = [{"sides": ["bare", "conveyor"], "seconds": {"bare": [4.0, 4.0], "conveyor": [2.0, 2.0]},
                "conveyor_comm_per_step": {}}]
    d = bench.derive({}, first, swapped)
    assert d["paired_ratios"] == [0.5, 0.5, 2.0, 2.0]  # bare / conveyor in both orders, pooled
    assert d["paired_median_by_build_order"] == [0.5, 2.0] and d["paired_median"] == pytest.approx(1.25)
    assert "paired median by build order" in bench.table({}, d)
    aa = [{"sides": ["bare", "bare2"], "seconds": {"bare": [2.0], "bare2": [1.0]}, "conveyor_comm_per_step": {}}]
    assert bench.derive({}, aa)["paired_ratios"] == [0.5]  # the 2nd-built's time / the 1st-built's
    assert bench.side_labels(["bare", "bare"]) == ["bare", "bare2"]


def test_parts_are_read_from_the_phase_boundaries(bench):
    mib = 2 ** 20
    level = {"base": 300, "built": 400, "wrapped": 350, "forward1": 351, "backward1": 400, "optimizer1": 500,
             "zeroed1": 455, "forward2": 456, "backward2": 505, "optimizer2": 505, "zeroed2": 455, "forward3": 457,
             "backward3": 505, "optimizer3": 505, "zeroed3": 455}
    high = dict(level, forward3=470, backward3=530, optimizer1=520)
    parts = bench.measured_parts({k: v * mib for k, v in level.items()}, {k: v * mib for k, v in high.items()})
    assert {k: v // mib for k, v in parts.items()} == {
        "baseline": 300, "parameters": 50, "optimizer_state": 100, "activations": 2, "gradients": 50,
        "forward_transient": 13, "backward_transient": 25, "optimizer_transient": 20, "standing_buffers": 5,
        "communication_buffers": 30}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_quick_run_measures_every_contender(bench, tmp_path):
    # conveyor's memory pair and the paired pair only (two pairs of processes, not four): the fast smoke run
    assert bench.main(["--quick", "--contenders", "conveyor", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "sharded-latest.json").read_text())
    assert not report["errors"], report["errors"]
    d = report["derived"]
    assert set(d["peak_rss_bytes"]) == {"conveyor"} and d["peak_rss_bytes"]["conveyor"] > 0
    parts = d["parts_bytes"]["conveyor"]  # measured: each part that holds whole blocks grew the RSS
    for part in ("parameters", "gradients", "optimizer_state", "communication_buffers"):
        assert parts[part] > 0, parts
    assert parts["optimizer_state"] > parts["parameters"] / 2, parts  # Adam's two moments per parameter
    assert parts["baseline"] + sum(parts[k] for k in bench.PARTS) <= d["peak_rss_bytes"]["conveyor"] * 1.1, parts
    assert "activations" in report["table"] and "comm" in report["table"]
    assert math.isfinite(d["steps_per_second"]["conveyor"]) and d["steps_per_second"]["conveyor"] > 0
    assert not report["all_pass"], "DDP was not measured: the memory goal must fail, not pass"
    assert len(d["paired_ratios"]) == 2 and all(r > 0 for r in d["paired_ratios"])
    comm = d["conveyor_comm_per_step"]
    assert comm["all_gather_seconds"] > 0 and comm["reduce_scatter_seconds"] > 0, comm
    assert "uptime" in report["machine"] and {g["name"] for g in report["goals"]} == {g.name for g in bench.GOALS}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_pipeline_fsdp_measures_four_ranks_each_holding_a_quarter(bench, tmp_path):
    """The pipeline_fsdp run at `--quick`'s size (no paired run): 4 processes as `conveyor run -n 4 --strategy
    pipeline --stages 2 --shard-stages` starts them (2 stages of 2 blocks, each sharded over 2 replicas), whose held
    parameters and Adam state (by numel) add up to the whole model's once each."""
    args = bench.parse_args(["--quick"])
    config = {"width": args.width, "depth": args.depth, "batch": args.batch, "steps": args.steps,
              "contender": "pipeline_fsdp"}
    ranks = bench.run_pair(config, tmp_path / "pipeline_fsdp", 300.0)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    whole = args.depth * (args.width ** 2 + args.width) * 4  # fp32 bytes
    assert sum(r["held"]["parameters"] for r in ranks) == whole, [r["held"] for r in ranks]
    assert sum(r["held"]["optimizer_state"] for r in ranks) == 2 * whole  # Adam's two moments, sharded alike
    assert all(r["held"]["parameters"] < whole / 2 for r in ranks)  # a stage's shard, not a stage
    assert all(r["peak_rss"] > 0 and len(r["seconds"]) == args.steps for r in ranks)
    assert set(ranks[0]["parts"]) >= set(bench.PARTS)
