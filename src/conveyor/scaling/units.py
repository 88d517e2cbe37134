"""Bandwidths and latencies as people write them: "25 Gbit/s", "12 GB/s", "5 us", "0.2 ms".

    parse_bandwidth("25 Gbit/s", "inter_node_bandwidth")   # -> 3.125e9 (bytes per second)
    parse_latency("5 us", "inter_node_latency")             # -> 5e-06 (seconds)

A plain number is bytes per second or seconds. A lower-case b is bits and an upper-case B bytes
("Gb/s" and "Gbps" are gigabits, "GB/s" gigabytes); decimal prefixes are powers of 1000, binary ones
(KiB, MiB, GiB) of 1024. A value that is not one of these raises ScalingInputError naming the field.
"""

from __future__ import annotations

import math
import re
from typing import Any

from conveyor.scaling.errors import ScalingInputError

__all__ = ["format_bandwidth", "format_seconds", "parse_bandwidth", "parse_latency"]

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_BANDWIDTH = re.compile(r"^([0-9.eE+-]+)\s*(|k|K|M|G|T|Ki|Mi|Gi|Ti)(bit|b|B)(?:/s|ps)$")
_LATENCY = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_SECONDS = re.compile(r"^([0-9.eE+-]+)\s*(s|ms|us|µs|ns)$")


def _number(text: str, field: str, example: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ScalingInputError(f"{field}: {text!r} is not a number; write it like {example}") from None
    return value


def _check(value: float, field: str, *, zero_ok: bool) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ScalingInputError(f"{field}: {value!r} must be a {'non-negative' if zero_ok else 'positive'} "
                                f"finite number")
    return value


def parse_bandwidth(value: Any, field: str) -> float:
    """Bytes per second from a number (bytes/s) or a string with a unit (module docstring)."""
    example = '"25 Gbit/s", "12 GB/s" or a number of bytes per second'
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ScalingInputError(f"{field}: expected a bandwidth like {example}, got {value!r}")
    if not isinstance(value, str):
        return _check(float(value), field, zero_ok=False)
    m = _BANDWIDTH.match(value.strip())
    if m is None:
        raise ScalingInputError(f"{field}: {value!r} is not a bandwidth; write it like {example} (b: bits, B: bytes)")
    number = _number(m.group(1), field, example)
    per_unit = _PREFIX[m.group(2)] / (8.0 if m.group(3) in ("bit", "b") else 1.0)
    return _check(number * per_unit, field, zero_ok=False)


def parse_latency(value: Any, field: str) -> float:
    """Seconds from a number (seconds) or a string with a unit: s, ms, us (or µs), ns."""
    example = '"5 us", "0.2 ms" or a number of seconds'
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ScalingInputError(f"{field}: expected a latency like {example}, got {value!r}")
    if not isinstance(value, str):
        return _check(float(value), field, zero_ok=True)
    m = _SECONDS.match(value.strip())
    if m is None:
        raise ScalingInputError(f"{field}: {value!r} is not a latency; write it like {example}")
    return _check(_number(m.group(1), field, example) * _LATENCY[m.group(2)], field, zero_ok=True)


def format_bandwidth(bytes_per_second: float) -> str:
    """'3.12 GB/s (25.0 Gbit/s)': bytes and bits, for tables."""
    return f"{bytes_per_second / 1e9:.3g} GB/s ({bytes_per_second * 8 / 1e9:.3g} Gbit/s)"


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
