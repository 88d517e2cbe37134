"""Data-parallel strategies behind one interface (:class:`Strategy`), picked by name.

    strategy = get_strategy("allreduce")

Implemented: ``local`` (one process, no communication), ``allreduce`` (DistributedDataParallel) and
the parameter-server strategies ``ps-sync``, ``ps-async``, ``ps-ssp:K`` (bounded staleness K;
:mod:`conveyor.strategies.ps.strategy`), and ``pipeline`` (pipeline model parallelism, combined with
data parallelism: :mod:`conveyor.strategies.pipeline.strategy`).
"""

from __future__ import annotations

from conveyor.strategies.allreduce import AllReduceStrategy
from conveyor.strategies.base import Strategy, check_optimizer
from conveyor.strategies.local import LocalStrategy
from conveyor.strategies.pipeline.strategy import PipelineStrategy
from conveyor.strategies.ps.strategy import PSStrategy

__all__ = ["NAMES", "AllReduceStrategy", "LocalStrategy", "PSStrategy", "PipelineStrategy", "Strategy",
           "check_optimizer", "get_strategy"]

_IMPLEMENTED: dict[str, type[Strategy]] = {"local": LocalStrategy, "allreduce": AllReduceStrategy,
                                           "pipeline": PipelineStrategy}
_PS = ("ps-sync", "ps-async", "ps-ssp:K")

#: Every strategy name conveyor knows, as the command line spells them.
NAMES: tuple[str, ...] = (*_IMPLEMENTED, *_PS)


def get_strategy(name: str) -> Strategy:
    """A new, not yet set up strategy for ``name``; ``ValueError`` naming the choices for anything else."""
    if not isinstance(name, str):
        raise ValueError(f"strategy = {name!r}; expected one of {_quoted(NAMES)}")
    key = name.strip().lower()
    if key in _IMPLEMENTED:
        return _IMPLEMENTED[key]()
    if key.startswith("ps-ssp"):
        _, _, k = key.partition(":")
        if not (k.isascii() and k.isdigit()):
            raise ValueError(f"strategy = {name!r}: ps-ssp needs its staleness bound K, a whole number >= 0, "
                             f"e.g. 'ps-ssp:4'")
        return PSStrategy("ssp", int(k))
    if key in ("ps-sync", "ps-async"):
        return PSStrategy(key[3:])
    raise ValueError(f"unknown strategy {name!r}; expected one of {_quoted(NAMES)}")


def _quoted(names) -> str:
    return ", ".join(f"'{n}'" for n in names)
