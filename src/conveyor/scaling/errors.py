"""The error of the scaling model's inputs: a summary.json or cluster description it cannot use."""

from __future__ import annotations

from conveyor.errors import ConveyorError

__all__ = ["ScalingInputError"]


class ScalingInputError(ConveyorError, ValueError):
    """A missing or wrong input of ``conveyor predict``; the message names the file, the field and the fix."""
