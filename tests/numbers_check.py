"""Small checks the benchmark smoke tests share."""

from __future__ import annotations

import math


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0
