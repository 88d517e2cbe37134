"""The scaling model's arithmetic: collectives, parameter-server exchanges, overlap and the pipeline bubble.

    ring_allreduce_seconds(nbytes, n, bandwidth, latency, messages=1)
    hierarchical_allreduce_seconds(nbytes, per_node, nodes, intra=(bw, lat), inter=(bw, lat), messages=1)
    ps_exchange_seconds(nbytes, workers, servers, server_bandwidth, worker_bandwidth, latency)
    exposed_seconds(communication, backward, overlap)
    bubble_fraction(stages, microbatches)
    agreement_seconds(n, latency)

Pure functions of seconds, bytes and bytes per second; the formulas and their assumptions are in
docs/scaling-model.md.
"""

from __future__ import annotations

import math

__all__ = ["agreement_seconds", "bubble_fraction", "exposed_seconds", "hierarchical_allreduce_seconds",
           "ps_exchange_seconds", "ring_allreduce_seconds"]


def ring_allreduce_seconds(nbytes: float, n: int, bandwidth: float, latency: float, messages: int = 1) -> float:
    """A ring all-reduce of `nbytes` over `n` workers: 2(n-1)/n x nbytes / bandwidth + 2(n-1) x latency
    per message (each of the `messages` buckets pays the ring's 2(n-1) steps of latency)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency * max(1, messages)


def hierarchical_allreduce_seconds(nbytes: float, per_node: int, nodes: int, intra: tuple[float, float],
                                   inter: tuple[float, float], messages: int = 1) -> float:
    """Reduce-scatter inside each node, a ring all-reduce across nodes, all-gather inside each node.

    After the reduce-scatter each of the `per_node` workers holds nbytes/per_node; the per_node rings
    across nodes run at once and share the node's link, which therefore carries 2(nodes-1)/nodes x
    nbytes, as a flat ring's would; what the hierarchy saves is latency (2(nodes-1) steps, not 2(N-1)).
    """
    inside = 0.0
    if per_node > 1:  # reduce-scatter + all-gather: together the bytes and steps of one ring all-reduce
        inside = ring_allreduce_seconds(nbytes, per_node, intra[0], intra[1], messages)
    return inside + ring_allreduce_seconds(nbytes, nodes, inter[0], inter[1], messages)


def ps_exchange_seconds(nbytes: float, workers: int, servers: int, server_bandwidth: float,
                        worker_bandwidth: float, latency: float) -> float:
    """Every worker sends (or receives) `nbytes`, split evenly over `servers` parameter servers.

    Each server's link carries workers x nbytes / servers and each worker's link nbytes; the slower of
    the two sets the time, plus one message latency.
    """
    return max(workers * nbytes / (servers * server_bandwidth), nbytes / worker_bandwidth) + latency


def exposed_seconds(communication: float, backward: float, overlap: float) -> float:
    """The part of `communication` the step waits for: at most the share `overlap` of it runs under
    backward, and never more than backward lasts."""
    if communication <= 0:
        return 0.0
    return max((1 - overlap) * communication, communication - backward)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of a pipeline step with equal stages: (S-1)/(M+S-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def agreement_seconds(n: int, latency: float) -> float:
    """One small all-reduce per step (the workers agreeing to go on): 2 x ceil(log2 n) message latencies."""
    return 0.0 if n <= 1 else 2 * math.ceil(math.log2(n)) * latency
