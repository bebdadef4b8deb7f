"""What a search must beat to matter, given another search's plan (the idle candidates, the sharding rounds)."""

from __future__ import annotations

import math

from ethpipe.plan import Plan


def incumbent_bar_s(plan: Plan, time_s: float) -> float:
    """What another search's layouts must beat to matter, given a plan that is predicted ``time_s``: the
    search scores layouts under 1F1B, and a plan whose pipelines took faster schedules is priced under its
    own 1F1B score; comparing that score with a zb-h1 or interleaved price would prune layouts that would win
    under those schedules too. So the larger of the two: the plan's time where its score is below it
    (1F1B only, where pruning on the time is sound), else its score (1F1B against 1F1B). A caller still
    compares the final prices; a search told this bar may return a plan slower than ``plan``.
    Likewise a plan cut inside layers (``layers/sublayer_cuts.py``) is priced under its time in whole layers,
    which is what the search's scores of whole-layer layouts compare with."""
    search = plan.extra.get("search") or {}
    score = search.get("estimated_iteration_s")
    cuts = search.get("sublayer_cuts") or {}
    whole_s = cuts.get("whole_layers_s") if cuts.get("kept") else None
    if not math.isfinite(time_s):
        return time_s
    return max([time_s] + [float(x) for x in (score, whole_s) if x is not None])
