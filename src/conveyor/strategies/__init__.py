"""Data-parallel strategies behind one interface (:class:`Strategy`), picked by name.

    strategy = get_strategy("allreduce")

Implemented: ``local`` (one process, no communication), ``allreduce`` (DistributedDataParallel) and
the parameter-server strategies ``ps-sync``, ``ps-async``, ``ps-ssp:K`` (bounded staleness K;
:mod:`conveyor.strategies.ps.strategy`), and ``pipeline`` (pipeline model parallelism, combined with
data parallelism: :mod:`conveyor.strategies.pipeline.strategy`), and ``fsdp`` (sharded data parallelism,
FSDP2: :mod:`conveyor.strategies.fsdp`).
"""

from __future__ import annotations

from conveyor.cluster.strategy_name import NAMES, parse_strategy
from conveyor.strategies.allreduce import AllReduceStrategy
from conveyor.strategies.base import Strategy, check_optimizer
from conveyor.strategies.local import LocalStrategy
from conveyor.strategies.ps.strategy import PSStrategy

__all__ = ["NAMES", "AllReduceStrategy", "FSDPStrategy", "LocalStrategy", "PSStrategy", "PipelineStrategy",
           "Strategy", "check_optimizer", "get_strategy"]

_IMPLEMENTED: dict[str, type[Strategy]] = {"local": LocalStrategy, "allreduce": AllReduceStrategy}


def __getattr__(name: str):
    # The pipeline strategy is imported when asked for: torch.distributed.pipelining brings in torch._dynamo,
    # DTensor and sympy, 1.4 s of CPU that every task of every other strategy would pay at start.
    if name == "PipelineStrategy":
        from conveyor.strategies.pipeline.strategy import PipelineStrategy

        return PipelineStrategy
    if name == "FSDPStrategy":  # the same: FSDP2 brings in DTensor
        from conveyor.strategies.fsdp.strategy import FSDPStrategy

        return FSDPStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_strategy(name: str) -> Strategy:
    """A new, not yet set up strategy for ``name``; ``ValueError`` naming the choices for anything else
    (names are parsed by :func:`conveyor.cluster.strategy_name.parse_strategy`)."""
    parsed = parse_strategy(name)
    if parsed.uses_ps:
        return PSStrategy(parsed.mode, parsed.staleness)
    if parsed.kind == "pipeline":
        return __getattr__("PipelineStrategy")()
    if parsed.kind == "fsdp":
        return __getattr__("FSDPStrategy")()
    return _IMPLEMENTED[parsed.kind]()
