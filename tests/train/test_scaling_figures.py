"""summary.json's `scaling` block: per-worker batch and model bytes from every rank's counts, the input cost,
and the all-reduce bus bandwidth of a multi-worker run (which the allreduce strategy's `report` adds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from conveyor.strategies import AllReduceStrategy
from conveyor.train.profiler import StepProfiler
from conveyor.train.scaling_figures import local_counts, scaling_block


def job(strategy: str, world: int, shards: int):
    return SimpleNamespace(world_size=world, data_shard=(shards, 0), device="cpu",
                           strategy=SimpleNamespace(name=strategy))


def test_local_counts_are_this_rank_s_bytes_steps_and_input_work():
    model = nn.Linear(10, 4)  # 44 float32 parameters
    model.bias.requires_grad_(False)
    prof = StepProfiler()
    prof.sample_pipeline({"elements": 8, "stages": [{"stage": "map[processes]", "busy_seconds": 2.0}]})
    assert local_counts(model, prof) == [44 * 4, 40 * 4, 0.0, 2.0, 8.0, 1.0]
    assert local_counts(None, StepProfiler()) == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_data_parallel_block_averages_over_the_workers():
    # 2 workers, each 176 bytes, 10 steps of 32 samples; 2 s of map work for 16 batches in all
    summed = [352.0, 352.0, 20.0, 2.0, 16.0, 2.0]
    block = scaling_block(summed, job=job("allreduce", 2, 2), samples=640.0)
    strategy = AllReduceStrategy()
    strategy.setup(job("allreduce", 2, 2))
    block = strategy.report({"scaling": block, "step_breakdown": {"communication": 0.001}})["scaling"]
    assert block["batch_size"] == 32 and block["parameter_bytes"] == block["gradient_bytes"] == 176
    assert block["input_core_seconds_per_batch"] == pytest.approx(2.0 / 16)
    assert block["device"] == "cpu" and block["compute_threads"] >= 1 and block["cpu_cores"] >= 1
    assert block["allreduce_bus_bandwidth"] == pytest.approx(2 * 1 / 2 * 176 / 0.001)


def test_pipeline_block_adds_the_stages_of_one_replica():
    # 4 processes = 2 replicas x 2 stages of 100 + 60 bytes; only stage 0 counts its 16-sample batches
    summed = [2 * 160.0, 2 * 160.0, 4 * 5.0, 0.0, 0.0, 0.0]
    block = scaling_block(summed, job=job("pipeline", 4, 2), samples=2 * 5 * 16.0)
    assert block["batch_size"] == 16 and block["parameter_bytes"] == 160
    assert block["input_core_seconds_per_batch"] is None  # no map stage reported busy time
    assert "allreduce_bus_bandwidth" not in block


def test_a_run_without_steps_or_model_leaves_them_unknown():
    block = scaling_block([0.0] * 6, job=job("local", 1, 1), samples=0.0, module_known=False)
    assert block["batch_size"] is None and block["parameter_bytes"] is None and block["gradient_bytes"] is None
