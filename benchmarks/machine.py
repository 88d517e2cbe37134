"""Facts about the machine a benchmark ran on, recorded in every benchmark's JSON."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def cpu_cores() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def machine_facts(packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """Date, cores, CPU model, platform, Python, and the versions of conveyor and `packages`."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    facts: dict[str, Any] = {"date": now_iso(), "cores": cpu_cores(), "cpu_count": os.cpu_count(), "cpu": cpu,
                             "platform": platform.platform(), "python": platform.python_version()}
    for name in ("conveyor", *packages):
        try:
            facts[name.lower()] = version(name)
        except PackageNotFoundError:
            facts[name.lower()] = None
    return facts
