"""Strategy names: the one parser and the one default, for the launcher, ``conveyor.init()`` and the ps task.

    parse_strategy(" PS-SSP:4 ")      # StrategyName(kind='ps', mode='ssp', staleness=4); .name == "ps-ssp:4"
    default_strategy(world_size=4, num_ps=0)   # "allreduce"

Names are matched ignoring case and surrounding whitespace. ``ps-ssp:K`` takes a staleness bound K, a
whole number >= 0 (ASCII digits). :data:`NAMES` spells every name as ``--help`` shows it.

This module only knows the names; which of them are implemented is ``conveyor.strategies``' business
(``get_strategy``), and which fit a job's shape is the launcher's (``launch.plan.resolve_strategy``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NAMES", "PS_MODES", "StrategyName", "default_strategy", "parse_strategy"]

#: The parameter-server update rules: ``ps-sync``, ``ps-async``, ``ps-ssp:K``.
PS_MODES: tuple[str, ...] = ("sync", "async", "ssp")
_PLAIN = ("local", "allreduce", "pipeline", "fsdp")

#: Every strategy name conveyor knows, implemented or not, as the command line spells them.
NAMES: tuple[str, ...] = ("local", "allreduce", "ps-sync", "ps-async", "ps-ssp:K", "pipeline", "fsdp")


@dataclass(frozen=True)
class StrategyName:
    """A parsed strategy name: ``kind`` is ``local``, ``allreduce``, ``ps``, ``pipeline`` or ``fsdp``; a ``ps``
    kind has a ``mode`` (``sync``, ``async``, ``ssp``) and, for ``ssp``, a ``staleness`` bound."""

    kind: str
    mode: str = ""
    staleness: int = 0

    @property
    def name(self) -> str:
        """The canonical spelling: ``"allreduce"``, ``"ps-sync"``, ``"ps-ssp:4"``."""
        if self.kind != "ps":
            return self.kind
        return f"ps-ssp:{self.staleness}" if self.mode == "ssp" else f"ps-{self.mode}"

    def __str__(self) -> str:
        return self.name

    @property
    def uses_ps(self) -> bool:
        """True for the parameter-server strategies, which need ps tasks in the job."""
        return self.kind == "ps"

    @property
    def splits_model(self) -> bool:
        """True for ``pipeline``, whose processes each hold stages of one model (``--stages``/``--split``)."""
        return self.kind == "pipeline"

    @property
    def distributed(self) -> bool:
        """False for ``local``, which trains one process alone."""
        return self.kind != "local"


def parse_strategy(text: object, *, what: str = "strategy") -> StrategyName:
    """The :class:`StrategyName` spelt by ``text`` (one already parsed is returned as it is); ``ValueError``
    naming the value and the choices otherwise.

    ``what`` names where the value came from in the message (the launcher passes ``"--strategy"``).
    """
    if isinstance(text, StrategyName):
        return text
    if not isinstance(text, str):
        raise ValueError(f"{what} = {text!r}; expected one of {_choices()}")
    key = text.strip().lower()
    if key in _PLAIN:
        return StrategyName(key)
    if key in ("ps-sync", "ps-async"):
        return StrategyName("ps", key[3:])
    if key.startswith("ps-ssp"):
        k = key.partition(":")[2]
        if not (k.isascii() and k.isdigit()):
            raise ValueError(f"{what} {text!r}: ps-ssp needs its staleness bound K, a whole number >= 0, "
                             f"e.g. 'ps-ssp:4'")
        return StrategyName("ps", "ssp", int(k))
    raise ValueError(f"unknown {what} {text!r}; expected one of {_choices()}")


def default_strategy(world_size: int, num_ps: int) -> str:
    """The strategy a job runs when none is named: ``ps-sync`` with parameter servers, ``allreduce`` with
    several training processes, ``local`` with one."""
    if num_ps:
        return "ps-sync"
    return "allreduce" if world_size > 1 else "local"


def _choices() -> str:
    return ", ".join(NAMES)
