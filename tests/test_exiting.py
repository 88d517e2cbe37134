"""conveyor.exiting: an exit that skips the collector's passes over what is still reachable and changes nothing
else a process's exit does (exit handlers in their order, finalized garbage, the exit status); a `conveyor`
command that loaded a user's code takes it only when asked (CONVEYOR_FAST_EXIT=1), as a training task."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conveyor.cluster.variables import FAST_EXIT_VAR

SCRIPT = """
import atexit, gc, sys
atexit.register(lambda: print("registered before", flush=True))
from conveyor import exiting
exiting.install()
exiting.install()  # a second call adds nothing

class Cycle:
    def __init__(self, name):
        self.name, self.me = name, self

    def __del__(self):
        print(self.name, "finalized", flush=True)

Cycle("garbage")  # unreachable at once, left to the collector: the handler's collection finalizes it
kept = Cycle("kept")  # reachable at exit: released with the process, not finalized one by one
atexit.register(lambda: print("registered after", flush=True))
sys.exit(3)
"""


def test_exit_handlers_run_garbage_is_finalized_and_the_status_kept(tmp_path: Path):
    gc_frozen = "import atexit, gc; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, flush=True))\n"
    script = tmp_path / "exit.py"
    script.write_text(gc_frozen + textwrap.dedent(SCRIPT))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stdout.splitlines()
    # exit handlers run last registered first: ours (between the two) collects, then freezes, before the first
    assert lines == ["registered after", "garbage finalized", "registered before", "frozen True"], lines


USER_MODULE = """
class Cycle:
    def __init__(self, name):
        self.name, self.me = name, self

    def __del__(self):
        print(self.name, "finalized", flush=True)

kept = Cycle("user's")  # a user's object in a reference cycle, reachable at exit


def pipeline():
    raise RuntimeError("no data here")  # refused before anything starts: the command exits 2 at once
"""


@pytest.mark.parametrize(("argv", "fast_exit", "expected"), [
    (["run", "--data-workers", "1", "--data-pipeline", "userpipe:pipeline", "train.py"], None,
     ["frozen False", "user's finalized"]),  # the launcher imported the user's pipeline: it exits as Python does
    (["run", "--data-workers", "1", "--data-pipeline", "userpipe:pipeline", "train.py"], "1", ["frozen True"]),
    (["--version"], None, ["frozen True"]),  # no user code: conveyor's own objects only, the quick exit
])
def test_a_conveyor_command_that_loads_user_code_exits_as_a_training_task(tmp_path: Path, argv, fast_exit, expected):
    (tmp_path / "userpipe.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "train.py").write_text("")
    code = ("import atexit, gc, sys; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, flush=True))"
            "\nfrom conveyor.cli.main import main\nsys.exit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if k != FAST_EXIT_VAR}
    env.update({FAST_EXIT_VAR: fast_exit} if fast_exit else {})
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=env)
    assert proc.returncode == (2 if "run" in argv else 0), proc.stderr
    if "run" in argv:
        assert "no data here" in proc.stderr, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("conveyor ")]  # --version's line
    assert lines == expected, proc.stdout
