"""The pipeline settings a job was started with (``conveyor run --stages/--microbatches/--schedule/--split``).

    given = pipeline_settings(job)       # PipelineSettings(stages=3, microbatches=None, schedule=None, ...)

They travel as ``PIPELINE_VARS`` in the environment the job was given (``conveyor.init(environ=...)``,
else the process's): this module is the one place that reads them, from ``job.environ``, so that the
pipeline strategy never reads ``os.environ`` and a mapping passed to ``conveyor.init`` is honoured.
A field is None when its variable is unset or blank; a malformed value is a ``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.cluster.variables import PIPELINE_VARS

__all__ = ["PipelineSettings", "pipeline_settings"]


@dataclass(frozen=True)
class PipelineSettings:
    """What the launcher said about the pipeline; None: not said (the strategy's default applies)."""

    stages: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    split: tuple[str, ...] | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> PipelineSettings:
        split = env.get(PIPELINE_VARS["split"], "").strip()
        return cls(stages=_whole(env, PIPELINE_VARS["stages"]), microbatches=_whole(env, PIPELINE_VARS["microbatches"]),
                   schedule=env.get(PIPELINE_VARS["schedule"], "").strip() or None,
                   split=tuple(s.strip() for s in split.split(",")) if split else None)


def pipeline_settings(job: Any) -> PipelineSettings:
    """The pipeline settings of ``job`` (its ``environ``: the mapping ``conveyor.init`` read)."""
    return PipelineSettings.from_environ(job.environ)


def _whole(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{name}={text!r}; expected a whole number")
    return int(text)
