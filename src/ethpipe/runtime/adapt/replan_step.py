"""`train --replan-after N`: the step at which the run asks for a better plan, and the decision every rank shares.

The replanner itself (fit the run, re-plan, compare: ``cli/learn.py``) is the command line's: the runtime only
calls it on rank 0 and broadcasts what it chose, so every rank switches (or not) alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ethpipe.plan import Plan
from ethpipe.runtime.checkpoint.layout import ResumePoint

Replanner = Callable[[Plan, list[dict[str, Any]]], tuple[Plan | None, dict[str, Any]]]


MIN_STEPS_BEFORE_REPLAN = 2  # the fit leaves the first step out (warm-up): it needs one more


@dataclass(frozen=True)
class Outcome:
    records: list[dict[str, Any]]  # rank 0's step records ([] elsewhere)
    switch_to: Plan | None = None  # --replan-after chose this plan; its checkpoint is written
    switch_step: int = 0  # the step that checkpoint holds (every rank resumes from exactly it)


def replan_due(replanner: Replanner | None, step: int, start: ResumePoint) -> bool:
    return replanner is not None and step + 1 - start.step == getattr(replanner, "after_steps", 0)


def decide_replan(replanner: Replanner, current: Plan, records: list[dict[str, Any]], rank: int,
                   control: dist.ProcessGroup | None) -> tuple[Plan | None, dict[str, Any]]:
    """Rank 0 fits and re-plans; every rank gets the same decision (the plan as a dict). A replanner that fails
    keeps the current plan, and says why, on every rank alike (no rank is left waiting in the broadcast)."""
    box: list[Any] = [None]
    if rank == 0:
        try:
            new, decision = replanner(current, records)
        except Exception as err:  # noqa: BLE001 - training goes on under the current plan
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            new, decision = None, {"switched": False, "error": why,
                                   "line": f"re-plan after {len(records)} steps failed ({why}): keeping the plan"}
        box = [(new.to_dict() if new is not None else None, decision)]
    dist.broadcast_object_list(box, src=0, group=control)
    data, decision = box[0]
    return (Plan.from_dict(data) if data is not None else None), decision
