"""Benchmarks are scripts, not package modules: load one by file path for its smoke test."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(stem: str):
    """Yield `benchmarks/<stem>.py` as a module, registered while in use (dataclasses look their
    module up while the file executes)."""
    name = f"conveyor_benchmarks_{stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def bench(request):
    """The benchmark a test module names in its `BENCHMARK` variable."""
    yield from load_benchmark(request.module.BENCHMARK)


@pytest.fixture
def other_benchmark():
    """Another benchmark, loaded for a `with` block: `with other_benchmark("ps") as ps: ...`."""
    return contextlib.contextmanager(load_benchmark)
