"""`make dist`: the wheel builds offline (no index asked) and holds the package and the `conveyor` command."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_wheel_builds_offline_and_holds_every_module_and_the_command(tmp_path):
    source = tmp_path / "source"  # what the build reads; its build/ and egg-info folders stay out of the checkout
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):  # README.md: the package's long description
        shutil.copy(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--wheel-dir", str(tmp_path / "dist"), str(source)],
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = list((tmp_path / "dist").glob("conveyor-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = wheel.read(info).decode()
        metadata = wheel.read(info.replace("entry_points.txt", "METADATA")).decode()
    modules = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "conveyor").rglob("*.py")}
    assert modules <= names, sorted(modules - names)[:10]  # every module, subpackages included
    assert "conveyor = conveyor.cli.main:main" in entry_points
    assert "Requires-Dist: torch" in metadata and "Provides-Extra: all" in metadata
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
