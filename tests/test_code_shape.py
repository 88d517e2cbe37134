"""The shape rules for ``src/``: small functions and classes, short module docstrings, no dangling doc links.

A function longer than ``MAX_FUNCTION_LINES`` or a class longer than ``MAX_CLASS_LINES`` needs a reason,
given in its docstring as a sentence starting "Long because". A module docstring states the module's
contract (what it is for, how to call it, what it promises); the design prose belongs in ``docs/``.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
MAX_MODULE_DOCSTRING_LINES = 25
REASON = "Long because"

def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _too_long(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit = MAX_FUNCTION_LINES
        elif isinstance(node, ast.ClassDef):
            limit = MAX_CLASS_LINES
        else:
            continue
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        length = node.end_lineno - start + 1
        if length > limit and REASON not in (ast.get_docstring(node) or ""):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} is {length} lines (limit {limit})")
    return found


def test_no_function_or_class_is_too_long_without_a_reason() -> None:
    found = [line for path in _modules() for line in _too_long(path)]
    assert not found, f"split these, or say why in a '{REASON} ...' sentence of the docstring:\n" + "\n".join(found)


def test_module_docstrings_state_the_contract_not_the_design() -> None:
    found = []
    for path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        if doc is not None and len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            found.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert not found, "move the design prose to docs/ and keep the contract:\n" + "\n".join(found)


def test_every_markdown_file_the_code_names_is_tracked() -> None:
    try:
        tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                     check=True).stdout.splitlines())
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        for name in re.findall(r"[\w./-]+\.md\b", path.read_text(encoding="utf-8")):
            if name not in tracked and f"docs/{name}" not in tracked:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "the code names documents that are not in the repository:\n" + "\n".join(missing)
