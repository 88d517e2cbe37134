"""Step time, samples/s, scaling efficiency and the limiting bound of N workers on a target cluster.

    points = predict(measured, cluster, Options(overlap=0.5), workers=(1, 2, 4, 8), strategies=STRATEGIES)
    for p in points: p.strategy, p.workers, p.step_seconds, p.samples_per_second, p.efficiency, p.bound

Strategies: ``allreduce`` (flat ring), ``allreduce-hierarchical`` (reduce-scatter in the node, ring
across nodes, all-gather), ``ps-sync``, ``ps-async`` (``cluster.ps_count`` servers whose links the
workers share) and ``pipeline`` (``Options.stages`` stages of ``Options.microbatches`` microbatches,
N / stages data-parallel replicas; N must be a multiple of the stages). Efficiency is samples/s over
N x the samples/s of one worker of the same cluster. The bound is ``input`` when the input pipeline
is slower than the rest of the step, else the largest of ``compute``, ``communication``, ``bubble``
and ``server`` (the parameter servers' own update work, ps-async). Formulas: docs/scaling-model.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from conveyor.scaling.cluster import Cluster
from conveyor.scaling.comm import (
    agreement_seconds,
    exposed_seconds,
    hierarchical_allreduce_seconds,
    ps_exchange_seconds,
    ring_allreduce_seconds,
)
from conveyor.scaling.errors import ScalingInputError
from conveyor.scaling.measured import Measured

__all__ = ["BOUNDS", "DEFAULT_WORKERS", "STRATEGIES", "Options", "Point", "predict", "single_worker_step"]

STRATEGIES = ("allreduce", "allreduce-hierarchical", "ps-sync", "ps-async", "pipeline")
BOUNDS = ("input", "compute", "communication", "bubble", "server")
DEFAULT_WORKERS = tuple(2**i for i in range(11))  # 1 ... 1024


@dataclasses.dataclass(frozen=True)
class Options:
    """The model's own parameters (not the cluster's).

    overlap: the share of gradient communication that can run under backward (bucketed all-reduce,
        pushes from autograd hooks); backward_fraction: backward's share of forward + backward;
    bucket_bytes: gradient bytes per all-reduce call (DDP: 25 MiB; each call pays the latency terms);
    stages, microbatches: the pipeline; activation_bytes: bytes per sample a stage sends to the next
        (the same again travels back as its gradient); not measured by conveyor, 0 by default.
    """

    overlap: float = 0.5
    backward_fraction: float = 2 / 3
    bucket_bytes: float = 25 * 2**20
    stages: int = 4
    microbatches: int = 8
    activation_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name, low, high in (("overlap", 0.0, 1.0), ("backward_fraction", 0.0, 0.999)):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ScalingInputError(f"{name} must be between {low} and {high}, got {value!r}")
        if not self.bucket_bytes > 0 or self.activation_bytes < 0:
            raise ScalingInputError("bucket_bytes must be > 0 and activation_bytes >= 0")
        if self.stages < 1 or self.microbatches < 1:
            raise ScalingInputError(f"stages and microbatches must be >= 1, got {self.stages} and {self.microbatches}")


@dataclasses.dataclass(frozen=True)
class Point:
    """One prediction: seconds per step of one worker (of one replica, for a pipeline), the job's samples/s,
    the efficiency, the bound, and the step's parts in seconds (``communication`` is the exposed part,
    ``communication_total`` all of it)."""

    strategy: str
    workers: int
    nodes: int
    step_seconds: float
    samples_per_second: float
    efficiency: float
    bound: str
    parts: dict[str, float]


@dataclasses.dataclass(frozen=True)
class _Step:
    parts: dict[str, float]
    samples: float  # samples the whole job completes per step
    floor: float = 0.0  # a step can take no less (ps-async: the servers' links and update work) ...
    floor_bound: str = ""  # ... and what sets that floor


def _worker(m: Measured, c: Cluster) -> dict[str, float]:
    """One worker's own costs on the target: compute scaled by its speed, input by its cores."""
    return {"compute": m.compute / c.compute_speed, "optimizer": m.optimizer / c.compute_speed,
            "overhead": m.overhead, "input": (m.input_core_seconds or 0.0) / c.cores_per_gpu}


def _largest(parts: dict[str, float]) -> str:
    return max(parts.items(), key=lambda kv: kv[1])[0]


def _finish(strategy: str, n: int, c: Cluster, step: _Step, base_rate: float) -> Point:
    p = step.parts
    path = {"compute": p["compute"] + p["optimizer"] + p["overhead"], "communication": p["communication"],
            "bubble": p.get("bubble", 0.0), "server": p.get("server", 0.0)}
    busy = sum(path.values())
    if c.compute_shares_cores:  # the input pipeline takes its cores from the compute: one after the other
        seconds, bound = p["input"] + busy, _largest({"input": p["input"], **path})
    else:  # prefetching: the pipeline works while the step runs; the slower of the two sets the pace
        seconds, bound = max(p["input"], busy), ("input" if p["input"] > busy else _largest(path))
    if step.floor > seconds:
        seconds, bound = step.floor, step.floor_bound
    rate = step.samples / seconds
    return Point(strategy, n, c.nodes(n), seconds, rate, rate / (n * base_rate), bound, dict(p))


def single_worker_step(m: Measured, c: Cluster) -> float:
    """Seconds per step of one worker alone on the target cluster (the efficiency's reference)."""
    w = _worker(m, c)
    rest = w["compute"] + w["optimizer"] + w["overhead"]
    return w["input"] + rest if c.compute_shares_cores else max(w["input"], rest)


def _allreduce(m: Measured, c: Cluster, o: Options, n: int, hierarchical: bool) -> _Step:
    w = _worker(m, c)
    messages = max(1, math.ceil(m.gradient_bytes / o.bucket_bytes))
    nodes, per_node = c.nodes(n), min(n, c.gpus_per_node)
    bandwidth, latency = c.link(n)
    if hierarchical and nodes > 1:
        total = hierarchical_allreduce_seconds(m.gradient_bytes, per_node, nodes,
                                               (c.intra_node_bandwidth, c.intra_node_latency),
                                               (c.inter_node_bandwidth, c.inter_node_latency), messages)
    else:
        total = ring_allreduce_seconds(m.gradient_bytes, n, bandwidth, latency, messages)
    exposed = exposed_seconds(total, o.backward_fraction * w["compute"], o.overlap) + agreement_seconds(n, latency)
    return _Step({**w, "communication": exposed, "communication_total": total}, n * m.batch_size)


def _ps_links(c: Cluster, n: int) -> tuple[float, float, float]:
    """(each server's bandwidth, each worker's bandwidth, latency): one node's link once the job spans nodes."""
    worker_bw, latency = c.link(n)
    return (c.ps_bandwidth or worker_bw), worker_bw, latency


def _ps_sync(m: Measured, c: Cluster, o: Options, n: int) -> _Step:
    w = _worker(m, c)
    server_bw, worker_bw, latency = _ps_links(c, n)
    push = ps_exchange_seconds(m.gradient_bytes, n, c.ps_count, server_bw, worker_bw, latency)
    pull = ps_exchange_seconds(m.parameter_bytes, n, c.ps_count, server_bw, worker_bw, latency)
    # the optimizer runs on the servers, each on its 1/ps_count of the parameters, between push and pull
    exposed = exposed_seconds(push, o.backward_fraction * w["compute"], o.overlap) + pull
    parts = {**w, "optimizer": 0.0, "server": w["optimizer"] / c.ps_count,
             "communication": exposed + agreement_seconds(n, latency), "communication_total": push + pull}
    return _Step(parts, n * m.batch_size)


def _ps_async(m: Measured, c: Cluster, o: Options, n: int) -> _Step:
    """Workers never wait for each other; the servers' links and update work cap the steps per second."""
    w = _worker(m, c)
    server_bw, worker_bw, latency = _ps_links(c, n)
    push = ps_exchange_seconds(m.gradient_bytes, 1, 1, worker_bw, worker_bw, latency)
    pull = ps_exchange_seconds(m.parameter_bytes, 1, 1, worker_bw, worker_bw, latency)
    exposed = exposed_seconds(push, o.backward_fraction * w["compute"], o.overlap) + pull
    parts = {**w, "optimizer": 0.0, "communication": exposed, "communication_total": push + pull}
    # per worker step, the servers' links carry n x bytes / ps_count, and each applies n updates of 1/ps_count
    link_floor = n * max(m.gradient_bytes, m.parameter_bytes) / (c.ps_count * server_bw)
    update_floor = n * w["optimizer"] / c.ps_count
    return _Step(parts, n * m.batch_size, max(link_floor, update_floor),
                 "communication" if link_floor >= update_floor else "server")


def _pipeline(m: Measured, c: Cluster, o: Options, n: int) -> _Step | None:
    s, mb = o.stages, o.microbatches
    if n < s or n % s:
        return None
    w = _worker(m, c)
    replicas = n // s
    slot = w["compute"] / (s * mb)  # one microbatch on one stage, the stages balanced
    bandwidth, latency = (c.intra_node_bandwidth, c.intra_node_latency) if s <= c.gpus_per_node else \
        (c.inter_node_bandwidth, c.inter_node_latency)
    send = 2 * (o.activation_bytes * m.batch_size / mb / bandwidth + latency) if s > 1 else 0.0
    # each replica's stage all-reduces its 1/stages of the gradients with the same stage of the other replicas
    group_bw, group_latency = c.link(n) if replicas > 1 else (c.intra_node_bandwidth, c.intra_node_latency)
    grads = m.gradient_bytes / s
    total = ring_allreduce_seconds(grads, replicas, group_bw, group_latency, max(1, math.ceil(grads / o.bucket_bytes)))
    exposed = exposed_seconds(total, o.backward_fraction * slot, o.overlap)
    parts = {**w, "compute": mb * slot, "optimizer": w["optimizer"] / s, "bubble": (s - 1) * (slot + send),
             "communication": exposed + mb * send + agreement_seconds(n, latency),
             "communication_total": total + (mb + s - 1) * send}
    return _Step(parts, replicas * m.batch_size)


def predict(measured: Measured, cluster: Cluster, options: Options | None = None,
            workers: Iterable[int] = DEFAULT_WORKERS, strategies: Sequence[str] = STRATEGIES) -> list[Point]:
    """Every (strategy, N) point (module docstring); pipeline points with N not a multiple of the stages
    are left out."""
    options = options or Options()
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ScalingInputError(f"unknown strategy {', '.join(unknown)}; the model knows {', '.join(STRATEGIES)}")
    counts = sorted({int(n) for n in workers})
    if not counts or counts[0] < 1:
        raise ScalingInputError(f"worker counts must be positive whole numbers, got {list(workers)}")
    base_rate = measured.batch_size / single_worker_step(measured, cluster)
    points = []
    for strategy in strategies:
        for n in counts:
            step = _step(strategy, measured, cluster, options, n)
            if step is not None:
                points.append(_finish(strategy, n, cluster, step, base_rate))
    return points


def _step(strategy: str, m: Measured, c: Cluster, o: Options, n: int) -> _Step | None:
    if strategy.startswith("allreduce"):
        return _allreduce(m, c, o, n, hierarchical=strategy == "allreduce-hierarchical")
    if strategy == "ps-sync":
        return _ps_sync(m, c, o, n)
    if strategy == "ps-async":
        return _ps_async(m, c, o, n)
    return _pipeline(m, c, o, n)
