"""A process's interpreter exit without the garbage collector's passes over everything it imported.

``install()`` registers, once per process, an exit handler that collects the garbage there is, then freezes
every object left (``gc.freeze``). The ``conveyor`` command (launcher, ps and data-service roles: conveyor's own
code) calls it; a training task only with ``CONVEYOR_FAST_EXIT=1`` (the test suite sets it), since a user's
objects in reference cycles could still hold unwritten data. ``user_code()``: a process that has loaded a user's
code (a ``conveyor`` command importing a data pipeline) follows the training tasks' rule from then on.

Why: a process that imported torch, and torch._dynamo with it (an optimizer's first step and DDP import it),
spends about a second of CPU at exit in the collector's passes over those modules (0.45 s with torch alone, as
a launcher hosting a rendezvous has): in a short task a fifth of its CPU, paid by every task on every start.

What stays the same: every exit handler (registered before or after this one) still runs, standard streams
and logging are flushed, and garbage that exists when the handler runs is collected, finalizers included.
What changes: objects still reachable at exit are not scanned by the collector's last passes, so those in
reference cycles are never finalized (their memory goes with the process); the others are still released one
by one as the interpreter clears its modules.
"""

from __future__ import annotations

import atexit
import gc
import os
from collections.abc import Mapping

from conveyor.cluster.variables import FAST_EXIT_VAR

_installed = False
_withdrawn = False


def install() -> None:
    """Register the exit handler (a second call does nothing)."""
    global _installed
    if not _installed and not _withdrawn:
        _installed = True
        atexit.register(_freeze)


def asked(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user (or the test suite) asked a process running user code for the quick exit."""
    return (os.environ if environ is None else environ).get(FAST_EXIT_VAR) == "1"


def user_code(environ: Mapping[str, str] | None = None) -> None:
    """This process now holds a user's objects: withdraw the handler (now and for later ``install()`` calls)
    unless :func:`asked`, since a user's object in a reference cycle may still have data to write."""
    global _installed, _withdrawn
    if not asked(environ):
        _withdrawn = True
        if _installed:
            _installed = False
            atexit.unregister(_freeze)


def _freeze() -> None:
    gc.collect()
    gc.freeze()
