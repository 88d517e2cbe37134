"""TEST-ONLY fault injection: a task kills itself (SIGKILL) at a chosen point of a checkpoint save.

    CONVEYOR_FAULT="worker:0:after-seal:20"    # task worker:0, after it sealed step 20; any step if omitted
    CONVEYOR_FAULT="ps:0:part-written"         # a parameter server, after it wrote one part of a step

Inert unless `CONVEYOR_FAULT` is set: `point()` is one dict lookup then. It fires in the first attempt only
(`CONVEYOR_RESTART_COUNT` 0; never in a worker restarted alone, `CONVEYOR_REJOIN`), so that the restarted job
can show it survives the crash. For the crash tests (`tests/train/test_save_crash.py`); never set it in a real
job. The points, in the order of a save (`conveyor.train.checkpoint.store`): `part-written` (a task's part
staged), `after-parts` (the chief's files and every part in its temporary folder), `after-manifest` (COMPLETE
written, not yet made durable), `after-seal` (the folder durable), `before-rename` (an older save of the step
moved aside), `after-rename` (the commit point), `after-latest`, `during-rotation` (one old step moved to the
trash); and `after-step` (the Trainer, once step N is done: the stall benchmark's failure). docs/training.md,
"Checkpoints on disk", says what the job does after each. Under asynchronous saves (the default) the points
after `part-written` fire in the writer thread: SIGKILL ends the process. Before it, the task says when on
stderr (`conveyor fault: SIGKILL ... time T`): the launcher's record of the restart reads it
(conveyor.recovery).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from conveyor.cluster.variables import FAULT_VAR, REJOIN_VAR, RESTART_COUNT_VAR, TASK_INDEX_VAR, TASK_TYPE_VAR

__all__ = ["POINTS", "point"]

POINTS = ("part-written", "after-parts", "after-manifest", "after-seal", "before-rename", "after-rename",
          "after-latest", "during-rotation", "after-step")


def point(name: str, step: int) -> None:
    """Kill this process here if `CONVEYOR_FAULT` names this task, point `name` and (if given) `step`."""
    spec = os.environ.get(FAULT_VAR)
    if not spec or os.environ.get(RESTART_COUNT_VAR, "0") != "0" or os.environ.get(REJOIN_VAR):
        return
    fields = spec.split(":")
    if name not in fields:
        return
    at = fields.index(name)
    task, steps = ":".join(fields[:at]), fields[at + 1:]
    me = f"{os.environ.get(TASK_TYPE_VAR, '')}:{os.environ.get(TASK_INDEX_VAR, '')}"
    if task in (me, "*") and (not steps or steps[0] == str(step)):
        print(f"conveyor fault: SIGKILL at {name} step {step} time {time.time():.6f}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
