"""Facts about the machine a benchmark ran on, recorded in every benchmark's JSON."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
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


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages, to show how busy the machine was around a measurement."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def write_results(name: str, report: dict[str, Any], out_dir: str | os.PathLike) -> Path:
    """Write `report` to `<out_dir>/<name>-<UTC stamp>.json` and `<name>-latest.json`.

    The JSON is strict: a failed sample (NaN, inf) is written as null; numpy values and paths as
    their plain equivalents.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    text = json.dumps(_strict(report), indent=1, default=_plain, allow_nan=False)
    path = out / f"{name}-{stamp}.json"
    path.write_text(text)
    (out / f"{name}-latest.json").write_text(text)
    return path


def _strict(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def _plain(x: Any) -> Any:
    if hasattr(x, "tolist"):  # numpy scalars and arrays
        return _strict(x.tolist())
    return str(x)
