"""The pre-flight exchange: every rank's input checks, settled world-wide before any long wait.

Each rank checks its inputs on its own node (the data file, the checkpoint, the plan against the world).
Raising straight away would leave the ranks whose checks passed waiting for it in the first collective
until ``--timeout-s`` (310 s by default) and dying with a store time-out that names nothing. Instead each
rank joins the world, and one object all-gather over the gloo control group tells every rank every
outcome within seconds: the lowest failing rank raises its own one-line error (naming the rank and its
host), every other rank ends with ``ReportedElsewhere`` (exit 2, nothing printed), so the cause shows once.
After the stages are built, a CPU barrier with the start-up timeout waits for the slowest rank
(``wait_for_every_rank``) before the first step's point-to-point.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ethpipe.errors import ReportedElsewhere, UserError
from ethpipe.runtime.start.watchdog import Watchdog


def settle(problem: UserError | None, group: dist.ProcessGroup | None, payload: Any = None) -> list[Any]:
    """Collective over the world: raise the first failing rank's error there, ``ReportedElsewhere`` elsewhere;
    else every rank's ``payload`` (what else start-up compares across ranks rides in the same exchange: the
    plan's key, the device: one world-wide collective instead of three)."""
    mine = None if problem is None else (socket.gethostname(), str(problem).splitlines()[0])
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (mine, payload), group=group)
    failed = [(rank, o) for rank, (o, _) in enumerate(outcomes) if o is not None]
    if not failed:
        return [p for _, p in outcomes]
    first, (host, message) = failed[0]
    if dist.get_rank() == first:
        others = f" ({len(failed) - 1} more ranks failed their checks too)" if len(failed) > 1 else ""
        raise UserError(f"rank {first} on {host}: {message}{others}")
    raise ReportedElsewhere(f"rank {first} on {host}: {message}")


def wait_for_every_rank(start_timeout_s: float, watchdog: Watchdog, control: dist.ProcessGroup | None) -> None:
    """A CPU barrier (gloo: the control group, or the gloo world) with the start-up timeout before the first
    step: ranks finish building and loading their stages minutes apart, and the first point-to-point would
    otherwise wait for the slowest under the collective timeout. Names a rank that never arrives."""
    watchdog.beat("waiting for every rank to finish start-up", limit_s=start_timeout_s + 60)
    dist.monitored_barrier(group=control, timeout=timedelta(seconds=start_timeout_s))
