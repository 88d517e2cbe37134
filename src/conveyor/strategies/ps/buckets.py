"""Gradient buckets: pieces ready in backward wait here until about a bucket's worth can travel at once.

    buckets = GradientBuckets(num_servers=2, bucket_bytes=DEFAULT_BUCKET_BYTES)
    buckets.add(piece.server, piece.key, copy)          # each piece of a parameter whose gradient is ready
    if buckets.full:                                    # send it now
        for server, keys, grads in buckets.take():
            send(server, Push(..., keys, grads))
    ...
    for server, keys, grads in buckets.take():         # what is left when the step ends

One message per gradient tensor (ResNet-20 has 65) costs a header, signatures, a ZeroMQ send and a
reply each, on both sides, and wakes the server once per tensor; one message per bucket costs that
once per ~MiB. DDP buckets gradients for the same reason. The bucket is shared by all servers: when it
fills, every server with pieces in it gets one push. Why the server's sums do not change:
docs/ps.md, "The parameter-server strategy", "Buckets".
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "GradientBuckets"]

#: About this many bytes of gradients per push (as DDP's first bucket): large enough that the per-message
#: cost is noise next to the bytes, small enough that the first pushes leave while backward still runs.
DEFAULT_BUCKET_BYTES = 1 << 20


class GradientBuckets:
    """Gradient pieces waiting to be pushed, per server, in the order backward made them.

    A piece added twice before it is taken (a second ``backward`` of the same step, accumulating) keeps
    only the newer values: the server would replace the older ones anyway. ``bucket_bytes = 0`` sends
    every gradient on its own (one push per parameter and server).
    """

    def __init__(self, num_servers: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes = {bucket_bytes!r}; expected a whole number of bytes >= 0 (0: one push "
                             f"per gradient)")
        self.bucket_bytes = bucket_bytes
        self._waiting: list[dict[str, torch.Tensor]] = [{} for _ in range(num_servers)]
        self.nbytes = 0

    def add(self, server: int, key: str, grad: torch.Tensor) -> None:
        """Keep ``grad`` (a copy the caller will not change) for ``server``."""
        waiting = self._waiting[server]
        old = waiting.pop(key, None)
        if old is not None:
            self.nbytes -= old.numel() * old.element_size()
        waiting[key] = grad
        self.nbytes += grad.numel() * grad.element_size()

    @property
    def full(self) -> bool:
        """Whether what waits is a bucket's worth (``bucket_bytes``) or more."""
        return len(self) > 0 and self.nbytes >= self.bucket_bytes

    def take(self) -> list[tuple[int, list[str], list[torch.Tensor]]]:
        """``(server, keys, grads)`` for every server with pieces waiting, in server order; empties the bucket."""
        out = [(server, list(waiting), list(waiting.values())) for server, waiting in enumerate(self._waiting)
               if waiting]
        self._waiting = [{} for _ in self._waiting]
        self.nbytes = 0
        return out

    def __len__(self) -> int:
        return sum(len(waiting) for waiting in self._waiting)
