"""FSDP2's all-gathers and reduce-scatters, timed: the seconds each kind took on this rank.

    clock = CommClock()
    time_collectives(sharded_modules, clock)    # every FSDPModule; before its first step
    clock.seconds()                             # {"all_gather_seconds": ..., "reduce_scatter_seconds": ...}

It installs FSDP2's own collective hooks (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``,
torch >= 2.8) with the default collectives subclassed, so FSDP2 runs exactly the collectives it would have, and
reads the clock around each call: two ``perf_counter`` reads per collective, no synchronisation added. What it
measures: on CPU/gloo (synchronous) each collective's whole wall time; on CUDA, or for an all-gather issued
with ``async_op=True`` (explicit prefetch), only the launch, because the transfer runs on FSDP2's own stream.
On gloo the reduce-scatter is an all-reduce underneath, so it costs about twice a same-sized all-gather.
Where torch lacks the hooks nothing is installed and the clock stays at 0.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from torch import nn

try:  # private module of torch's FSDP2; its default collectives are what FSDP2 would run without us
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:  # torch before 2.8: no custom-collective hooks to time through
    DefaultAllGather = DefaultReduceScatter = None  # type: ignore[assignment,misc]

__all__ = ["CommClock", "time_collectives"]

KINDS = ("all_gather", "reduce_scatter")


class CommClock:
    """Seconds and calls of FSDP2's all-gathers and reduce-scatters on this rank (module docstring)."""

    def __init__(self) -> None:
        self._seconds = dict.fromkeys(KINDS, 0.0)
        self.calls: Counter[str] = Counter()

    def add(self, kind: str, seconds: float) -> None:
        self._seconds[kind] += seconds
        self.calls[kind] += 1

    def seconds(self) -> dict[str, float]:
        """``{"all_gather_seconds": s, "reduce_scatter_seconds": s}`` so far."""
        return {f"{kind}_seconds": self._seconds[kind] for kind in KINDS}

    def total(self) -> float:
        return sum(self._seconds.values())


def time_collectives(modules: Iterable[nn.Module], clock: CommClock) -> bool:
    """Time every FSDP module's all-gathers and reduce-scatters into `clock`; False where torch cannot."""
    if DefaultAllGather is None:
        return False
    modules = [m for m in modules if hasattr(m, "set_custom_all_gather") and hasattr(m, "set_custom_reduce_scatter")]
    if not modules:
        return False
    gather, scatter = _TimedAllGather(clock), _TimedReduceScatter(clock)
    for module in modules:
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
    return True


class _Timed:
    """FSDP2's default collective (the class this is mixed into), its wall time added to the clock as `kind`."""

    kind = ""

    def __init__(self, clock: CommClock) -> None:
        super().__init__()
        self._clock = clock

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._clock.add(self.kind, time.perf_counter() - start)


if DefaultAllGather is not None:

    class _TimedAllGather(_Timed, DefaultAllGather):  # type: ignore[misc,valid-type]
        kind = "all_gather"

    class _TimedReduceScatter(_Timed, DefaultReduceScatter):  # type: ignore[misc,valid-type]
        kind = "reduce_scatter"
