"""A process's interpreter exit without the garbage collector's passes over everything it imported.

``install()`` registers, once per process, an exit handler that collects the garbage there is, then freezes
every object left (``gc.freeze``). The ``conveyor`` command (launcher, ps and data-service roles: conveyor's own
code) calls it; a training task only with ``CONVEYOR_FAST_EXIT=1`` (the test suite sets it), since a user's
objects in reference cycles could still hold unwritten data.

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

_installed = False


def install() -> None:
    """Register the exit handler (a second call does nothing)."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(_freeze)


def _freeze() -> None:
    gc.collect()
    gc.freeze()
