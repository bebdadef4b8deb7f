"""One planning call run ahead in a second process while this one plans something else (``idle.py``).

The idle search plans the whole cluster and, independently, the cluster without its slowest type:
on a machine with a second core the two run at once. Only where that is safe and cheap: Linux
``fork`` (the child inherits the planner's state, nothing is re-imported), at least two CPUs, no
other thread alive in this process (a fork copies only the calling thread, and a lock another
thread holds would stay held in the child), and not from inside a daemonic process (which may not
have children). The child only computes and sends back the return value or the exception; if it
cannot (it died, or the value does not pickle) ``result`` says so and the caller runs the call
itself, so the plan never depends on whether a second process was used.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

MISSING = object()  # ``result`` when the child gave nothing back


def can_run_ahead() -> bool:
    """Whether a forked child may plan alongside this process (module docstring)."""
    return (sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
            and (os.cpu_count() or 1) >= 2 and threading.active_count() == 1
            and not multiprocessing.current_process().daemon)


class Ahead:
    """``fn()`` running in a forked child from construction; ``result()`` waits for it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        ctx = multiprocessing.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)

        def run() -> None:
            try:
                out: tuple[str, Any] = ("returned", fn())
            except Exception as err:  # noqa: BLE001  (handed to the parent, which re-raises it)
                out = ("raised", err)
            try:
                send.send(out)
            except Exception:  # noqa: BLE001  (does not pickle: the parent runs fn itself)
                pass
            finally:
                send.close()

        self._proc = ctx.Process(target=run, daemon=True, name="ethpipe-plan-ahead")
        self._proc.start()
        send.close()

    def result(self) -> Any:
        """``fn()``'s return value (its exception is raised here), or ``MISSING`` if the child gave nothing."""
        try:
            kind, value = self._recv.recv()
        except (EOFError, OSError):
            return MISSING
        finally:
            self.cancel()
        if kind == "raised":
            raise value
        return value

    def cancel(self) -> None:
        """Stop the child (if it still runs) and reap it."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._recv.close()
