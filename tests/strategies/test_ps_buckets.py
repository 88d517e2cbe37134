"""Gradient buckets: what waits and what leaves, and that the size of the buckets changes no result bit.

Two workers run as threads of this process against in-process ps tasks (``ps-sync``), each with its
own ``PSClient``; the reference is one model stepped with the mean of both workers' gradients.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from conveyor.launch.ports import free_ports
from conveyor.strategies.ps.buckets import DEFAULT_BUCKET_BYTES, GradientBuckets
from conveyor.strategies.ps.client import PSClient
from conveyor.strategies.ps.optim import mean_of_gradients
from conveyor.strategies.ps.server import ParameterServer

SECRET = b"ps-buckets-test-secret"
STEPS = 3


def test_a_bucket_fills_in_order_replaces_a_piece_added_again_and_empties_when_taken() -> None:
    buckets = GradientBuckets(num_servers=2, bucket_bytes=40)
    buckets.add(1, "b[0:4]", torch.ones(4))
    buckets.add(0, "a[0:2]", torch.ones(2))
    assert not buckets.full and buckets.nbytes == 24
    buckets.add(1, "b[0:4]", torch.full((4,), 2.0))  # a second backward of the step: the newer copy wins
    assert not buckets.full and buckets.nbytes == 24 and len(buckets) == 2
    buckets.add(1, "c[0:4]", torch.ones(4))
    assert buckets.full
    taken = buckets.take()
    assert [(server, keys) for server, keys, _ in taken] == [(0, ["a[0:2]"]), (1, ["b[0:4]", "c[0:4]"])]
    assert torch.equal(taken[1][2][0], torch.full((4,), 2.0))
    assert buckets.take() == [] and buckets.nbytes == 0 and not buckets.full


def test_bucket_bytes_0_sends_every_gradient_alone_and_bad_sizes_are_refused() -> None:
    buckets = GradientBuckets(num_servers=1, bucket_bytes=0)
    assert not buckets.full  # nothing waits
    buckets.add(0, "a[0:1]", torch.ones(1))
    assert buckets.full
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="bucket_bytes"):
            GradientBuckets(num_servers=1, bucket_bytes=bad)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 1, generator=generator)


def _worker(rank: int, model: nn.Module, addresses: list[str], bucket_bytes: int, out: dict) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # chunk_bytes 256: the larger weights are cut into pieces on both servers
    client = PSClient(addresses, SECRET, rank=rank, num_workers=2, sender=f"worker:{rank}", timeout=30.0,
                      chunk_bytes=256, bucket_bytes=bucket_bytes)
    try:
        client.connect(model, optimizer)
        for step in range(STEPS):
            optimizer.zero_grad()
            inputs, targets = _batch(rank, step)
            nn.functional.mse_loss(model(inputs), targets).backward()
            client.finish_step()
        out[rank] = ([p.detach().clone() for p in model.parameters()], [s.counters for s in client.stats()])
    finally:
        client.close()


def _train(bucket_bytes: int) -> tuple[list[torch.Tensor], list[dict[str, int]]]:
    """Two workers, two ps tasks: each worker's final parameters (equal) and the servers' counters."""
    ports = free_ports(2)
    servers = [ParameterServer(f"127.0.0.1:{p}", SECRET, index=i, num_workers=2, mode="sync").start()
               for i, p in enumerate(ports)]
    out: dict = {}
    models = [_model(), _model()]  # here: torch's global RNG is not for threads
    threads = [threading.Thread(target=_worker, args=(r, models[r], [f"127.0.0.1:{p}" for p in ports], bucket_bytes,
                                                      out)) for r in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60.0)
    finally:
        for server in servers:
            server.close()
    assert sorted(out) == [0, 1], "a worker failed (its exception is printed above)"
    assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0], strict=True))
    return out[0][0], out[1][1]


def _reference() -> list[torch.Tensor]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    for step in range(STEPS):
        grads = []
        for rank in range(2):
            model.zero_grad()
            inputs, targets = _batch(rank, step)
            nn.functional.mse_loss(model(inputs), targets).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads, strict=True):
            p.grad = mean_of_gradients(per_rank)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_any_bucket_size_gives_the_same_bits_as_one_model_stepped_with_the_mean_gradient() -> None:
    reference = _reference()
    pushes = {}
    for bucket_bytes in (0, 300, DEFAULT_BUCKET_BYTES):
        params, counters = _train(bucket_bytes)
        assert all(torch.equal(a, b) for a, b in zip(params, reference, strict=True)), bucket_bytes
        pushes[bucket_bytes] = [c["pushes"] for c in counters]
    # one push per server and step in 1 MiB buckets; more in small ones; one per gradient without
    assert pushes[DEFAULT_BUCKET_BYTES] == [2 * STEPS, 2 * STEPS]
    assert all(2 * STEPS < small < alone for small, alone in zip(pushes[300], pushes[0], strict=True)), pushes
