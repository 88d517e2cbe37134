"""The job's collectives through ps:0, for workers that run apart (``ps-async``, ``ps-ssp:K``).

    collectives = ServerCollectives(client, world_size=2, rank=1)
    job.use_collectives(collectives)        # job.barrier / all_gather_bytes / broadcast_bytes / all_reduce go here
    collectives.all_reduce(torch.tensor([3.0]))   # every worker's tensors, reduced on each worker

Why: a worker of such a job that dies is restarted alone (docs/ps.md, "A worker restarted alone"), and the
replacement cannot join the workers' torch process group: a gloo group takes no new member. So from the end of
the training loop on (``Step.finish``), and in a replacement from its start, the workers meet on ps:0 instead:
each collective is a numbered meeting (``meet`` requests; the server answers with every worker's bytes once all
are in). The originals meet nowhere else after their start, and a replacement takes no part in the start-up
collectives (it resumes from the servers, not from a checkpoint), so the numbers agree: meeting 0 is every
worker's end-of-training barrier. Promises: the results equal the process group's (reductions in rank order,
on the CPU, in the tensor's dtype); every meeting waits at most the client's timeout.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ServerCollectives"]

_REDUCE = {"sum": torch.add, "mean": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}


class ServerCollectives:
    """Barrier, all-gather, broadcast and all-reduce among the workers as meetings on ps:0 (module docstring)."""

    def __init__(self, client: Any, *, world_size: int, rank: int) -> None:
        self.client = client
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.meetings = 0  # the next meeting's number

    def _meet(self, data: bytes) -> list[bytes]:
        key, self.meetings = self.meetings, self.meetings + 1
        return self.client.meet(key, data)

    def barrier(self) -> None:
        self._meet(b"")

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return self._meet(data)

    def broadcast_bytes(self, data: bytes, src: int) -> bytes:
        return self._meet(data if self.rank == src else b"")[src]

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """``tensor`` reduced over the workers with ``op`` (sum, mean, max, min, product), in place."""
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        parts = [torch.frombuffer(bytearray(b), dtype=torch.uint8).view(flat.dtype) if b else flat[:0].clone()
                 for b in self._meet(flat.view(torch.uint8).numpy().tobytes())]
        result = parts[0].clone()
        for part in parts[1:]:
            result = _REDUCE[op](result, part)
        if op == "mean":
            result = result / self.world_size if result.is_floating_point() else result // self.world_size
        tensor.copy_(result.reshape(tensor.shape).to(tensor.device))
        return tensor
