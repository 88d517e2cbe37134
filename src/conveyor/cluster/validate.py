"""The checks of a job's settings, in one place: each takes a value and ``where`` it came from, and returns
the value in its one form or raises ``ValueError`` naming ``where`` (a flag, a variable) and the fix.

    count(4, "--stages", 1, "pipeline stages")               # 4
    seconds(0, "--timeout", zero_ok=False, most=86400)        # ValueError: --timeout 0: expected ...
    strategy("PS-SSP:4", "--strategy")                         # StrategyName('ps', 'ssp', 4)
    layer_names("blocks.2, head", "--split")                   # ('blocks.2', 'head')

:class:`conveyor.cluster.settings.JobSettings` names a check per field (the launchers' flags), and
``from_text`` reads a variable's text with the same rules (the tasks' side). Checks that relate
several settings to the job's shape (``pipeline_shape``, ``tf_flags``) are here too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from conveyor.cluster.strategy_name import StrategyName, parse_strategy

__all__ = ["MAX_TIMEOUT", "count", "flag", "layer_names", "optional_count", "pipeline_shape", "replicas_for_shards",
           "seconds", "strategy", "text", "tf_flags", "timeout"]

#: The longest --timeout: one day. A longer collective or rendezvous timeout is a typo, or a hang unnoticed.
MAX_TIMEOUT = 86400.0


def count(value: object, where: str, low: int, what: str = "") -> int:
    """``value``, a whole number >= ``low``; ``what`` says what it counts in the message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where} {value!r}: expected a whole number >= {low}{f' ({what})' if what else ''}")
    return value


def optional_count(low: int, what: str):
    """A check for an optional count (``None``: not given)."""
    def check(value: object, where: str) -> int | None:
        return None if value is None else count(value, where, low, what)
    return check


def seconds(value: object, where: str, *, zero_ok: bool, most: float, example: str = "") -> float:
    """``value`` as float seconds: finite, > 0 (or >= 0 with ``zero_ok``), at most ``most``."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value <= most
    # a NaN fails every comparison; inf the last one, or math.isfinite where there is no most
    if not ok or not math.isfinite(value) or (value == 0 and not zero_ok):
        low = ">= 0" if zero_ok else "> 0"
        most_text = f" and at most {most:g}" if math.isfinite(most) else ""
        raise ValueError(f"{where} {value!r}: expected a finite number of seconds {low}{most_text}"
                         f"{f', {example}' if example else ''}")
    return float(value)


def timeout(value: object, where: str) -> float:
    """The job's timeout: finite seconds > 0 (the launchers also cap it at :data:`MAX_TIMEOUT`)."""
    example = f"e.g. {where} 300" if where.startswith("--") else "e.g. 300"
    return seconds(value, where, zero_ok=False, most=math.inf, example=example)


def strategy(value: object, where: str) -> StrategyName | None:
    """A strategy name, parsed once (:func:`conveyor.cluster.strategy_name.parse_strategy`); ``None``: the
    default for the job's shape."""
    if value is None or isinstance(value, StrategyName):
        return value
    if where.startswith("--"):
        return parse_strategy(value, what=where)
    try:  # a variable: "CONVEYOR_STRATEGY: unknown strategy 'x'; ..."
        return parse_strategy(value)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def flag(value: object, where: str) -> bool:
    """A yes/no setting."""
    if not isinstance(value, bool):
        raise ValueError(f"{where} {value!r}: expected True or False")
    return value


def text(value: object, where: str) -> str | None:
    """An optional word such as a schedule's name, stripped; ``None``: not given."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where} {value!r}: expected a name, e.g. {where} 1f1b")
    return value.strip()


def folder(value: object, where: str) -> str | None:
    """An optional folder path (absolute or not: each launcher says which it needs)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{where} {value!r}: expected a folder path")
    return value


def layer_names(value: object, where: str) -> tuple[str, ...] | None:
    """Layer names to cut a model before: ``"a,b"`` or a sequence of names, as a tuple; ``None``: not given."""
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where} {value!r}: expected layer names, e.g. {where} blocks.2,blocks.4")
    cleaned = tuple(n.strip() for n in names)
    if not cleaned or not all(cleaned):
        raise ValueError(f"{where} {value!r}: expected comma-separated layer names (named_modules names), none "
                         f"empty, e.g. {where} blocks.2,blocks.4")
    return cleaned


def from_text(kind: type, text_value: str, where: str) -> object:
    """A variable's text as ``kind`` (int, float, str): the tasks' reading of a setting."""
    value = text_value.strip()
    if kind is int:
        if not (value.isascii() and value.isdigit()):
            raise ValueError(f"{where}={value!r} is not a whole number >= 0; the launcher sets it (unset it for the "
                             f"default)")
        return int(value)
    if kind is float:
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{where}={value!r} is not a number of seconds; e.g. {where}=300") from None
    return value


def pipeline_shape(strategy_name: StrategyName | None, workers: int, stages: int | None,
                   given: Sequence[str], split: Sequence[str] | None, *, shard_stages: bool = False) -> None:
    """The pipeline flags against the job: they need ``--strategy pipeline``, which needs a split, and every
    replica runs all stages (``workers`` a multiple of ``stages``); ``--shard-stages`` needs two replicas or more
    (:func:`shard_stages`). ``given``: the pipeline flags given."""
    pipeline = strategy_name is not None and strategy_name.splits_model
    if given and not pipeline:
        raise ValueError(f"{', '.join(given)} belong(s) to pipeline parallelism: add --strategy pipeline, or drop "
                         f"{'them' if len(given) > 1 else 'it'}")
    if pipeline and stages is None and not split:
        raise ValueError("--strategy pipeline needs the split: --stages S (an nn.Sequential cut into S stages "
                         "balanced by parameter bytes) or --split NAME,NAME (the layers to cut before)")
    if stages is not None and workers % stages:
        raise ValueError(f"-n {workers} --stages {stages}: each pipeline replica runs all {stages} "
                         f"stages, so -n must be a multiple of {stages} (e.g. -n {stages})")
    if shard_stages and stages is not None:
        replicas_for_shards(workers // stages, stages, workers)


def replicas_for_shards(replicas: int, stages: int, workers: int) -> None:
    """``--shard-stages`` shards each stage across its replicas: with one replica there is nothing to shard
    across, and a silent no-op would hide the -n that was meant (the memory saving would not happen)."""
    if replicas < 2:
        raise ValueError(f"--shard-stages with -n {workers} --stages {stages}: each stage has {replicas} replica, "
                         f"so there is nothing to shard it across; run -n {2 * stages} (2 shards per stage) or more, "
                         f"or drop --shard-stages")


def fsdp_flags(strategy_name: StrategyName | None, given: Sequence[str]) -> None:
    """The fsdp flags ``given`` need ``--strategy fsdp``."""
    if given and (strategy_name is None or strategy_name.kind != "fsdp"):
        raise ValueError(f"{', '.join(given)} belong(s) to sharded data parallelism: add --strategy fsdp, or drop "
                         f"{'them' if len(given) > 1 else 'it'}")


def tf_flags(tf: bool, chief: bool) -> None:
    """TensorFlow 1's cluster flags know no chief job."""
    if tf and chief:
        raise ValueError("--tf-flags gives TensorFlow 1's --ps_hosts/--worker_hosts, which have no chief job "
                         "(worker 0 is the chief there): drop --chief, or drop --tf-flags and read TF_CONFIG")
