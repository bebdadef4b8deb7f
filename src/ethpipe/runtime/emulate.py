"""Heterogeneity emulation for CPU runs (``--emulate``).

Each rank stretches every forward/backward it runs by ``measured_s * (1/speed - 1)`` with a
sleep, where ``speed`` is its plan device type's speed relative to the fastest type in the
plan. A sleeping process frees its core, so six CPU processes behave like a mixed cluster and
ETH's data balance can be measured for real. Injected slowdowns (a straggler from step k on)
divide the speed further; ``Slowdown`` is the seam for a later ``--emulate-slowdown``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from ethpipe.plan import Plan


@dataclass(frozen=True)
class Slowdown:
    """Rank ``rank`` runs ``factor`` times slower from step ``from_step`` on."""

    rank: int
    factor: float
    from_step: int = 0

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"slowdown factor must be >= 1 (a slowdown), got {self.factor}")


def parse_slowdown(text: str) -> Slowdown:
    """``RANK:FACTOR@STEP`` (``@STEP`` optional) -> Slowdown."""
    try:
        head, _, step = text.partition("@")
        rank, factor = head.split(":")
        return Slowdown(int(rank), float(factor), int(step) if step else 0)
    except ValueError as err:
        if "slowdown factor" in str(err):
            raise
        raise ValueError(f"slowdown '{text}' must look like RANK:FACTOR@STEP, e.g. 3:2.0@10") from None


def relative_speeds(plan: Plan) -> dict[str, float]:
    """Device type -> relative speed (fastest in the plan = 1.0).

    From ``plan.extra["device_speeds"]`` (the planner writes it), else from the GPU catalog's
    achievable FLOP/s of each device id in the plan.
    """
    types = sorted({s.device for p in plan.pipelines for s in p.stages})
    given = plan.extra.get("device_speeds")
    if isinstance(given, Mapping):
        missing = [t for t in types if t not in given]
        if missing:
            raise ValueError(f"plan field 'device_speeds' has no speed for device type '{missing[0]}'")
        raw = {t: float(given[t]) for t in types}
    else:
        from ethpipe.catalog import get_gpu

        try:
            raw = {t: get_gpu(t).achievable_flops for t in types}
        except ValueError:
            raise ValueError(
                "--emulate needs relative device speeds: the plan has no 'device_speeds' field and its device "
                f"types ({', '.join(types)}) are not all GPU catalog ids; add \"device_speeds\": {{type: speed}}"
            ) from None
    if any(v <= 0 for v in raw.values()):
        raise ValueError("plan field 'device_speeds' must hold positive speeds")
    fastest = max(raw.values())
    return {t: v / fastest for t, v in raw.items()}


@dataclass(frozen=True)
class Emulator:
    """One rank's emulated speed; ``stretch`` is called after each measured compute."""

    speed: float  # relative to the fastest device type in the plan
    slowdowns: tuple[Slowdown, ...] = ()

    def extra_s(self, measured_s: float, step: int) -> float:
        factor = 1.0
        for s in self.slowdowns:
            if step >= s.from_step:
                factor *= s.factor
        return max(0.0, measured_s * (factor / self.speed - 1.0))

    def stretch(self, measured_s: float, step: int) -> float:
        """Sleep so this compute appears to have run at the emulated speed; returns the sleep."""
        extra = self.extra_s(measured_s, step)
        if extra > 0:
            time.sleep(extra)
        return extra


def make_emulator(plan: Plan, rank: int, slowdowns: tuple[Slowdown, ...] = ()) -> Emulator:
    for s in slowdowns:
        if not 0 <= s.rank < plan.world_size:
            raise ValueError(f"slowdown rank {s.rank} is not in the plan (world size {plan.world_size})")
    pos = plan.position_of(rank)
    device = plan.pipelines[pos.pipeline].stages[pos.stage].device
    return Emulator(relative_speeds(plan)[device], tuple(s for s in slowdowns if s.rank == rank))
