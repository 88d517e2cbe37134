"""A process's interpreter exit without the garbage collector's passes over everything it imported.

``install()`` registers, once per process, an exit handler that collects the garbage there is, then freezes
every object left (``gc.freeze``). ``conveyor.init()`` and the ``conveyor`` command call it.

Why: a process that imported torch, and torch._dynamo with it (an optimizer's first step and DDP import it),
spends about a second of CPU at exit in the collector's passes over those modules (0.45 s with torch alone, as
a launcher hosting a rendezvous has): in a short task a fifth of its CPU, paid by every task on every start.

What stays the same: every exit handler (registered before or after this one) still runs, standard streams
and logging are flushed, and garbage that exists when the handler runs is collected, finalizers included.
What changes: objects still reachable at exit are released by the operating system with the process, as
after ``os._exit``, instead of one by one.
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
