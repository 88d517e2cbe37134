"""The scaling model's arithmetic: collectives, ps exchanges, overlap, the bubble, and the bound of each point."""

from __future__ import annotations

import dataclasses
import math

import pytest

from conveyor.scaling import Cluster, Measured, Options, ScalingInputError, predict
from conveyor.scaling.comm import (
    agreement_seconds,
    bubble_fraction,
    exposed_seconds,
    hierarchical_allreduce_seconds,
    ps_exchange_seconds,
    ring_allreduce_seconds,
)
from conveyor.scaling.measured import compute_without_communication
from conveyor.scaling.model import single_worker_step

GB = 1e9
MEASURED = Measured(batch_size=32, compute=0.3, optimizer=0.0, overhead=0.0, gradient_bytes=100e6,
                    parameter_bytes=100e6)
# 4 workers per node; no latency, so that the bandwidth terms can be checked by hand
CLUSTER = Cluster(intra_node_bandwidth=10 * GB, intra_node_latency=0.0, inter_node_bandwidth=1 * GB,
                  inter_node_latency=0.0, gpus_per_node=4, cores_per_gpu=2, ps_count=2)


def point(points, strategy, n):
    return next(p for p in points if p.strategy == strategy and p.workers == n)


# ---------------------------------------------------------------------------------------------------------------------
# the formulas


def test_ring_allreduce_is_2_n_minus_1_over_n_bytes_plus_latency_per_step_and_bucket():
    assert ring_allreduce_seconds(100e6, 1, GB, 1e-5) == 0.0
    assert ring_allreduce_seconds(100e6, 2, GB, 0.0) == pytest.approx(0.1)  # 2 x 1/2 x 100 MB at 1 GB/s
    assert ring_allreduce_seconds(100e6, 4, GB, 0.0) == pytest.approx(2 * 3 / 4 * 0.1)
    # 8 workers, 10 us per message, 3 buckets: 2 x 7 steps of latency for each bucket
    assert ring_allreduce_seconds(100e6, 8, GB, 1e-5, messages=3) == pytest.approx(2 * 7 / 8 * 0.1 + 2 * 7 * 1e-5 * 3)


def test_hierarchical_moves_the_same_bytes_across_nodes_but_pays_fewer_latencies():
    intra, inter = (10 * GB, 1e-6), (GB, 1e-4)
    # 4 per node x 8 nodes: a ring inside the node (reduce-scatter + all-gather), then a ring of 8 nodes
    t = hierarchical_allreduce_seconds(100e6, 4, 8, intra, inter)
    assert t == pytest.approx(2 * 3 / 4 * 100e6 / (10 * GB) + 2 * 3 * 1e-6 + 2 * 7 / 8 * 0.1 + 2 * 7 * 1e-4)
    flat = ring_allreduce_seconds(100e6, 32, GB, 1e-4)
    assert flat - 2 * 31 / 32 * 0.1 == pytest.approx(2 * 31 * 1e-4)  # the flat ring's latency: 2(N-1) steps
    assert hierarchical_allreduce_seconds(100e6, 1, 8, intra, inter) == ring_allreduce_seconds(100e6, 8, *inter)
    tiny = 1e3  # latency-bound: the hierarchy wins
    assert hierarchical_allreduce_seconds(tiny, 4, 8, intra, inter) < ring_allreduce_seconds(tiny, 32, GB, 1e-4)


def test_ps_exchange_is_set_by_the_servers_shared_link_or_the_workers_own():
    # 8 workers x 100 MB over 2 servers at 1 GB/s each: 0.4 s; each worker's own link needs 0.1 s
    assert ps_exchange_seconds(100e6, 8, 2, GB, GB, 0.0) == pytest.approx(0.4)
    assert ps_exchange_seconds(100e6, 1, 4, GB, GB, 1e-3) == pytest.approx(0.1 + 1e-3)  # the worker's link
    assert ps_exchange_seconds(100e6, 8, 8, 2 * GB, GB, 0.0) == pytest.approx(0.1)


def test_overlap_hides_a_share_of_communication_but_never_more_than_backward():
    assert exposed_seconds(0.0, 0.2, 0.5) == 0.0
    assert exposed_seconds(0.1, 0.2, 0.5) == pytest.approx(0.05)  # half of it runs under backward
    assert exposed_seconds(0.1, 0.2, 0.0) == pytest.approx(0.1)  # no overlap
    assert exposed_seconds(0.1, 0.2, 1.0) == 0.0  # perfect overlap, backward long enough
    assert exposed_seconds(0.5, 0.2, 1.0) == pytest.approx(0.3)  # backward is too short to hide it all
    assert exposed_seconds(0.5, 0.2, 0.5) == pytest.approx(0.3)


def test_bubble_and_agreement():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert agreement_seconds(1, 1e-5) == 0.0
    assert agreement_seconds(8, 1e-5) == pytest.approx(6e-5)  # 2 x log2(8)
    assert agreement_seconds(5, 1e-5) == pytest.approx(6e-5)  # rounded up


@pytest.mark.parametrize("comm", [0.0, 0.01, 0.1, 0.5, 2.0])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 0.9])
def test_compute_is_recovered_from_a_multi_worker_step(comm, overlap):
    compute, backward_fraction = 0.3, 2 / 3
    measured_fb = compute + exposed_seconds(comm, backward_fraction * compute, overlap)
    assert compute_without_communication(measured_fb, comm, overlap, backward_fraction) == pytest.approx(compute)


# ---------------------------------------------------------------------------------------------------------------------
# the points


def test_one_worker_is_the_reference_and_data_parallel_samples_scale_with_n():
    points = predict(MEASURED, CLUSTER, Options(overlap=0.0), workers=[1, 2, 8], strategies=["allreduce"])
    one, two, eight = points
    assert one.efficiency == pytest.approx(1.0) and one.step_seconds == pytest.approx(0.3)
    assert one.samples_per_second == pytest.approx(32 / 0.3)
    # 2 workers in one node: a ring at 10 GB/s, nothing hidden
    assert two.parts["communication"] == pytest.approx(2 * 1 / 2 * 100e6 / (10 * GB))
    assert two.step_seconds == pytest.approx(0.3 + 0.01)
    assert two.samples_per_second == pytest.approx(2 * 32 / 0.31)
    assert two.efficiency == pytest.approx(0.3 / 0.31)
    # 8 workers on 2 nodes: the ring crosses the 1 GB/s network
    assert eight.nodes == 2 and eight.parts["communication"] == pytest.approx(2 * 7 / 8 * 0.1)


def test_bounds_are_named():
    slow_input = dataclasses.replace(MEASURED, input_core_seconds=1.0)  # 0.5 s per batch on 2 cores > 0.3 s
    p = predict(slow_input, CLUSTER, workers=[1], strategies=["allreduce"])[0]
    assert p.bound == "input" and p.step_seconds == pytest.approx(0.5)
    heavy = dataclasses.replace(MEASURED, gradient_bytes=2e9)  # 1 s to all-reduce across nodes
    p = point(predict(heavy, CLUSTER, Options(overlap=0.5), workers=[1, 64]), "allreduce", 64)
    assert p.bound == "communication" and p.parts["communication"] > p.parts["compute"]
    p = point(predict(MEASURED, CLUSTER, Options(stages=8, microbatches=2), workers=[8]), "pipeline", 8)
    assert p.bound == "bubble"  # 7 slots of idle against 2 of work
    p = point(predict(MEASURED, CLUSTER, workers=[1, 2]), "allreduce", 2)
    assert p.bound == "compute"


def test_input_takes_the_compute_s_cores_when_they_are_shared():
    m = dataclasses.replace(MEASURED, input_core_seconds=0.2)  # 0.1 s on 2 cores
    shared = dataclasses.replace(CLUSTER, compute_shares_cores=True)
    assert single_worker_step(m, CLUSTER) == pytest.approx(0.3)  # prefetching hides it
    assert single_worker_step(m, shared) == pytest.approx(0.4)  # one after the other
    p = predict(m, shared, workers=[1], strategies=["allreduce"])[0]
    assert p.step_seconds == pytest.approx(0.4) and p.bound == "compute"


def test_compute_speed_and_cores_scale_the_worker():
    fast = dataclasses.replace(CLUSTER, compute_speed=3.0)
    assert predict(MEASURED, fast, workers=[1], strategies=["allreduce"])[0].step_seconds == pytest.approx(0.1)


def test_ps_sync_waits_for_the_shared_servers_and_ps_async_is_capped_by_them():
    m = dataclasses.replace(MEASURED, optimizer=0.02)
    points = predict(m, CLUSTER, Options(overlap=0.0), workers=[1, 16], strategies=["ps-sync", "ps-async"])
    sync16 = point(points, "ps-sync", 16)
    push = pull = 16 * 100e6 / (2 * GB)  # 16 workers' 100 MB through 2 servers at 1 GB/s: 0.8 s each way
    assert sync16.parts["communication_total"] == pytest.approx(push + pull)
    assert sync16.parts["server"] == pytest.approx(0.01)  # the update, split over 2 servers
    assert sync16.step_seconds == pytest.approx(0.3 + push + pull + 0.01)
    assert sync16.bound == "communication"
    async16 = point(points, "ps-async", 16)
    # alone each worker needs 0.3 + 0.1 + 0.1 s per step across nodes; the servers can take 2 GB/s / 100 MB = 20 steps/s
    assert async16.step_seconds == pytest.approx(16 * 100e6 / (2 * GB))
    assert async16.samples_per_second == pytest.approx(20 * 32)
    assert async16.bound == "communication"
    # one worker on one node reaches its server over the node's 10 GB/s: 10 ms each way
    assert point(points, "ps-async", 1).step_seconds == pytest.approx(0.3 + 0.01 + 0.01)


def test_pipeline_efficiency_is_one_minus_the_bubble_without_communication():
    m = dataclasses.replace(MEASURED, gradient_bytes=0.0, parameter_bytes=0.0)
    for stages, micro in ((2, 8), (4, 4), (4, 16)):
        p = predict(m, CLUSTER, Options(stages=stages, microbatches=micro), workers=[stages], strategies=["pipeline"])
        assert p[0].efficiency == pytest.approx(1 - bubble_fraction(stages, micro))
        assert p[0].parts["bubble"] == pytest.approx((stages - 1) * 0.3 / (stages * micro))
    # N that is not a multiple of the stages has no pipeline point
    assert [p.workers for p in predict(m, CLUSTER, Options(stages=4), workers=[1, 2, 4, 6, 8],
                                       strategies=["pipeline"])] == [4, 8]


def test_pipeline_activations_cost_every_microbatch_a_send_each_way():
    m = dataclasses.replace(MEASURED, gradient_bytes=0.0)
    o = Options(stages=2, microbatches=4, activation_bytes=1e6)  # 32 samples: 8 MB per microbatch
    p = predict(m, CLUSTER, o, workers=[2], strategies=["pipeline"])[0]
    send = 2 * (1e6 * 32 / 4) / (10 * GB)
    assert p.parts["communication"] == pytest.approx(4 * send + agreement_seconds(2, 0.0))
    assert p.parts["bubble"] == pytest.approx(0.3 / 8 + send)


def test_bad_options_and_requests_are_named():
    with pytest.raises(ScalingInputError, match="overlap"):
        Options(overlap=1.5)
    with pytest.raises(ScalingInputError, match="stages"):
        Options(stages=0)
    with pytest.raises(ScalingInputError, match="unknown strategy horovod"):
        predict(MEASURED, CLUSTER, strategies=["horovod"])
    with pytest.raises(ScalingInputError, match="positive"):
        predict(MEASURED, CLUSTER, workers=[0, 2])


def test_every_default_point_is_finite():
    points = predict(dataclasses.replace(MEASURED, input_core_seconds=0.05, optimizer=0.01), CLUSTER)
    assert {p.workers for p in points} == {2**i for i in range(11)}
    for p in points:
        assert math.isfinite(p.step_seconds) and p.step_seconds > 0 and 0 < p.efficiency <= 1 + 1e-9
