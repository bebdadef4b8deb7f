"""A per-rank watchdog: end a rank that stops making progress, instead of leaving it hanging.

Every collective already has a timeout (``--timeout-s``), so a dead peer normally surfaces as an
error within that time. The watchdog is the backstop for what a collective timeout cannot see:
a rank stuck outside any collective (a wedged file system, a deadlock, an endless loop) while
its peers wait on it. The training loop ``beat``s at every phase; if no beat comes for
``limit_s``, the rank prints one line naming the phase and exits with ``WATCHDOG_EXIT_CODE``,
which makes the launcher (local spawn or torchrun) end the whole world.
"""

from __future__ import annotations

import os
import sys
import threading
import time

WATCHDOG_EXIT_CODE = 3


class Watchdog:
    """Daemon thread that exits the process when ``beat`` is not called for ``limit_s`` seconds."""

    def __init__(self, rank: int, limit_s: float, poll_s: float = 0.5) -> None:
        self.rank = rank
        self.limit_s = limit_s
        self._poll_s = min(poll_s, max(0.05, limit_s / 10))
        self._phase = "start-up"
        self._phase_limit_s = limit_s
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        if self.limit_s > 0:
            self._thread = threading.Thread(target=self._watch, name="ethpipe-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self, phase: str, limit_s: float | None = None) -> None:
        """Progress: now in ``phase`` (named in the message if it is where the rank gets stuck); ``limit_s``: this
        phase may take that long (a wait with a longer timeout of its own, like the start-up barrier)."""
        self._phase = phase
        self._phase_limit_s = self.limit_s if limit_s is None else max(limit_s, self.limit_s)
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            idle_s = time.monotonic() - self._last
            if idle_s > self._phase_limit_s:
                print(f"ethpipe watchdog: rank {self.rank} made no progress for {idle_s:.0f} s in '{self._phase}' "
                      f"(limit {self._phase_limit_s:g} s, --watchdog-s): exiting so the job does not hang",
                      file=sys.stderr, flush=True)
                os._exit(WATCHDOG_EXIT_CODE)
