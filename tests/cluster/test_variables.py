"""conveyor.cluster.variables: every CONVEYOR_* variable is named once, there, and has a row in its table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import conveyor
from conveyor.cluster import variables

SRC = Path(conveyor.__file__).parent
HOME = SRC / "cluster" / "variables.py"
NAME = re.compile(r"CONVEYOR_[A-Z_]*[A-Z]")


def _constants() -> dict[str, str]:
    return {k: v for k, v in vars(variables).items() if k.endswith("_VAR")}


def test_every_variable_is_a_constant_in_the_table() -> None:
    constants = _constants()
    assert sorted(constants.values()) == sorted(variables.NAMES)
    assert len(set(variables.NAMES)) == len(variables.NAMES)
    assert sorted(constants) == sorted(n for n in variables.__all__ if n.endswith("_VAR"))
    for row in variables.VARIABLES:
        assert row.name.startswith("CONVEYOR_") and row.meaning and row.set_by and row.read_by, row


def test_no_variable_name_is_spelt_out_as_a_value_outside_its_home() -> None:
    # A string that is exactly a variable's name is a use of it (env[...], os.environ.get(...)); text that
    # merely mentions one (a docstring, an error message, an f-string's literal part) is not.
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value!r}")
    assert not found, f"import the constant from conveyor.cluster.variables instead: {found}"


def test_every_variable_mentioned_in_src_is_in_the_table() -> None:
    mentioned = {m for path in SRC.rglob("*.py") for m in NAME.findall(path.read_text())}
    assert mentioned <= set(variables.NAMES), sorted(mentioned - set(variables.NAMES))


def test_the_old_homes_give_the_same_names() -> None:
    import conveyor.cli.run as run
    import conveyor.cluster.env as env
    import conveyor.launch as launch
    import conveyor.launch.plan as plan
    import conveyor.train.job as job

    for module in (env, plan, launch, job, run):
        for name, value in vars(module).items():
            if name.endswith("_VAR") and isinstance(value, str) and value.startswith("CONVEYOR_"):
                assert getattr(variables, name) == value, (module.__name__, name)
    assert (plan.RESTART_COUNT_VAR, plan.TTY_VAR, job.TIMEOUT_VAR, env.JOB_SECRET_VAR) == (
        "CONVEYOR_RESTART_COUNT", "CONVEYOR_TTY", "CONVEYOR_TIMEOUT", "CONVEYOR_JOB_SECRET")
