"""Whether the other machines' launchers are still there: heartbeats through the rendezvous store.

    heart = Heartbeat(twin, hosts=["host0 (10.0.0.1)", "host1 (10.0.0.2)"], timeout=300.0)
    heart.start()          # after the rendezvous; twin: a StorePeers on a connection of its own
    heart.stop()           # before leaving the job

Every launcher but node 0's writes a signed, growing beat count to the store every ``interval`` seconds,
from a thread of its own on a connection of its own: the run loop may be busy stopping tasks or pausing
between attempts. Node 0's thread reads the beats; a node that has not beaten for ``timeout`` seconds,
and has not left, is lost (its machine died, or is cut off): node 0 writes the job's abort record naming
it, and every launcher stops its tasks and fails (a job of fixed size cannot go on without one of its
machines; an elastic job's coordinator reads the beats itself and goes on: ``launch/elastic.py``). A
lost node 0 takes the store with it, which every other launcher's next call to it reports. Why:
docs/launcher.md, "Process groups and rendezvous".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

from conveyor.errors import PeerError

__all__ = ["Heartbeat", "beat_interval"]


class BeatStore(Protocol):
    """What the heartbeat needs of the store (``rendezvous.StorePeers`` on its own connection)."""

    node_rank: int
    nnodes: int

    def beat(self, count: int) -> None: ...

    def beat_of(self, node: int) -> int | None: ...

    def has_left(self, node: int) -> bool: ...

    def abort(self, description: str) -> None: ...

    def release(self) -> None: ...


def beat_interval(timeout: float) -> float:
    """Seconds between beats: a tenth of the time a silent node has before it counts as lost, at most 1 s."""
    return max(0.05, min(1.0, timeout / 10))


class Heartbeat:
    """The heartbeat thread of one launcher; see the module docstring. ``hosts[r]`` names node ``r``."""

    def __init__(self, store: BeatStore, *, hosts: Sequence[str], timeout: float) -> None:
        self._store = store
        self._hosts = list(hosts)
        self.timeout = timeout
        self.interval = beat_interval(timeout)
        self.lost: set[int] = set()  # nodes node 0 declared lost: nobody waits for them to leave
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread and close its connection (before the store itself goes: see StorePeers.close)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5.0)
        self._store.release()

    def _run(self) -> None:
        try:
            if self._store.node_rank == 0:
                self._watch()
            else:
                count = 0
                while True:
                    self._store.beat(count)
                    count += 1
                    if self._stop.wait(self.interval):
                        return
        except PeerError:
            return  # the store is gone: the run loop's own next call says so

    def _watch(self) -> None:
        others = range(1, self._store.nnodes)
        now = time.monotonic()
        last = {r: -1 for r in others}
        heard = {r: now for r in others}  # the rendezvous just ended: every node was there
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            for r in others:
                beat = self._store.beat_of(r)
                if beat is not None and beat > last[r]:  # a replayed older beat proves nothing
                    last[r], heard[r] = beat, now
            silent = [r for r in others if now - heard[r] > self.timeout and not self._store.has_left(r)]
            if silent:
                self.lost.update(silent)
                self._store.abort(self._describe(silent, now - min(heard[r] for r in silent)))
                return

    def _describe(self, silent: list[int], seconds: float) -> str:
        nodes = ", ".join(f"node {r} ({self._hosts[r]})" for r in silent)
        return (f"lost {nodes}: no heartbeat from its launcher for {seconds:.0f} s (--timeout {self.timeout:g}); "
                f"the machine is down or cut off from the rendezvous host, and the job cannot go on without it, so "
                f"every node stops. Start the job again on every node once the machine is back")
