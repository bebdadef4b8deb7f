"""Heterogeneity emulation for CPU runs (``--emulate``): pace every forward/backward to a target time.

Model: an action whose real compute took ``compute_s`` (this thread's CPU time on CPU, wall time
on an accelerator) is made to last ``target_s = compute_s * time_scale / speed`` of wall time,
by sleeping ``target_s - elapsed_s`` after it (sleeps only, so training stays exact).
``speed`` is the rank's device type's speed relative to the fastest type in the plan;
``time_scale`` (>= 1) slows *every* device, the fastest included, so that each rank's real
compute is only ``speed / time_scale`` of its emulated busy time. The default scale keeps the
whole world's real compute within ``CPU_SHARE`` of this machine's cores, so six ranks on two
cores never queue for a core and an action's duration does not depend on what the other ranks
do: measured CPU time excludes time spent descheduled, and pacing on the wall clock absorbs it.
Only forward/backward are paced; p2p, gradient all-reduce and the optimizer run at real speed.
Injected slowdowns (a straggler from step k on) divide the speed further (``--emulate-slowdown``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ethpipe.plan import Plan

# The default time scale keeps the real compute of all ranks within this fraction of the cores.
CPU_SHARE = 0.5


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


def local_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def auto_time_scale(rank_speeds: Sequence[float], num_cores: int) -> float:
    """Smallest scale >= 1 at which all ranks computing at once use at most ``CPU_SHARE`` of the cores.

    A rank's real compute is ``speed / time_scale`` of its emulated busy time, so the world
    needs at most ``sum(speeds) / time_scale`` cores.
    """
    if num_cores < 1 or not rank_speeds:
        raise ValueError("auto_time_scale needs at least one core and one rank")
    return max(1.0, sum(rank_speeds) / (CPU_SHARE * num_cores))


def emulation_time_scale(plan: Plan, num_cores: int | None = None) -> float:
    """The plan's ``emulation.time_scale`` if given, else ``auto_time_scale`` for its world on this machine."""
    section = plan.extra.get("emulation")
    if section is not None:
        if not isinstance(section, Mapping):
            raise ValueError("plan field 'emulation' must be an object like {\"time_scale\": 4.0}")
        given = section.get("time_scale")
        if given is not None:
            if isinstance(given, bool) or not isinstance(given, (int, float)) or given < 1.0:
                raise ValueError(f"plan field 'emulation.time_scale' must be a number >= 1, got {given!r}")
            return float(given)
    speeds = relative_speeds(plan)
    rank_speeds = [speeds[stage.device] for pipe in plan.pipelines for stage in pipe.stages for _ in stage.ranks]
    return auto_time_scale(rank_speeds, num_cores if num_cores is not None else local_cores())


def with_time_scale(plan: Plan, time_scale: float) -> Plan:
    """A copy of ``plan`` that pins the emulation time scale (so a prediction and a run agree on it)."""
    import dataclasses

    emulation = dict(plan.extra.get("emulation") or {})
    emulation["time_scale"] = float(time_scale)
    return dataclasses.replace(plan, extra={**plan.extra, "emulation": emulation})


@dataclass(frozen=True)
class Emulator:
    """One rank's emulated device: ``pace`` is called after each forward/backward."""

    speed: float  # relative to the fastest device type in the plan
    time_scale: float = 1.0  # every device runs this many times slower than the real one
    slowdowns: tuple[Slowdown, ...] = ()

    def slowdown(self, step: int) -> float:
        factor = 1.0
        for s in self.slowdowns:
            if step >= s.from_step:
                factor *= s.factor
        return factor

    def target_s(self, compute_s: float, step: int) -> float:
        """Emulated duration of an action whose real compute took ``compute_s``."""
        return compute_s * self.time_scale * self.slowdown(step) / self.speed

    def sleep_s(self, compute_s: float, elapsed_s: float, step: int) -> float:
        """Sleep that makes an action that has lasted ``elapsed_s`` of wall time last its target."""
        return max(0.0, self.target_s(compute_s, step) - elapsed_s)

    def pace(self, compute_s: float, elapsed_s: float, step: int) -> float:
        """Sleep up to the action's target duration; returns the sleep."""
        sleep = self.sleep_s(compute_s, elapsed_s, step)
        if sleep > 0:
            time.sleep(sleep)
        return sleep


def make_emulator(plan: Plan, rank: int, slowdowns: tuple[Slowdown, ...] = (),
                  num_cores: int | None = None) -> Emulator:
    for s in slowdowns:
        if not 0 <= s.rank < plan.world_size:
            raise ValueError(f"slowdown rank {s.rank} is not in the plan (world size {plan.world_size})")
    pos = plan.position_of(rank)
    device = plan.pipelines[pos.pipeline].stages[pos.stage].device
    return Emulator(relative_speeds(plan)[device], emulation_time_scale(plan, num_cores),
                    tuple(s for s in slowdowns if s.rank == rank))
