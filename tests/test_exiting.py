"""conveyor.exiting: an exit that skips the collector's passes over what is still reachable and changes nothing
else a process's exit does (exit handlers in their order, finalized garbage, the exit status)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
