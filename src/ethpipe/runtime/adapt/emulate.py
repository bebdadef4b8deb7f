"""Heterogeneity emulation for CPU runs (``--emulate``): pace every forward/backward to a target time.

Each forward/backward is made to last a *target* duration of wall time by sleeping after it
(sleeps only, so training stays exact). Two modes (``TrainConfig.emulate_mode``):

* ``"paced"`` (default): where the plan carries ``emulation.compute_s`` (per rank, per
  micro-batch size, emulated forward and backward seconds, as ``ethpipe demo`` writes them from
  a profile of this CPU scaled by ``time_scale / speed``), the target is that number. Targets are
  deterministic and independent of the machine's load, and they are exactly the compute times the
  simulator uses, so a paced run tests the schedule and the overheads, not the compute model.
  A plan without ``compute_s`` falls back to the measured rule below.
* ``"measured"``: ``target = compute_s * time_scale / speed`` for every action (any
  ``emulation.compute_s`` is ignored), where ``compute_s`` is the action's real compute (this
  thread's CPU time on CPU, wall time on an accelerator) and ``speed`` the rank's device type's
  speed relative to the fastest type. A slower emulated device takes proportionally longer than
  the real compute, so comparing a measured run with a prediction from a profile of this CPU
  tests the compute model too.

``time_scale`` (>= 1) slows *every* device, the fastest included, so that each rank's real
compute is only ``speed / time_scale`` of its emulated busy time; the default keeps the whole
world's real compute within ``CPU_SHARE`` of this machine's cores, so six ranks on two cores do
not queue for a core. A real compute longer than its target is not shortened (an overrun).
Only forward/backward are paced; p2p, gradient all-reduce and the optimizer run at real speed.
Injected slowdowns (a straggler from step k on) multiply the target (``--emulate-slowdown``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ethpipe.errors import UserError
from ethpipe.plan import Plan
from ethpipe.schedule import actions_of

# The default time scale keeps the real compute of all ranks within this fraction of the cores.
CPU_SHARE = 0.25
EmulateMode = Literal["paced", "measured"]
EMULATE_MODES: tuple[EmulateMode, ...] = ("paced", "measured")


@dataclass(frozen=True)
class Slowdown:
    """Rank ``rank`` runs ``factor`` times slower from step ``from_step`` on."""

    rank: int
    factor: float
    from_step: int = 0

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise UserError(f"slowdown factor must be >= 1 (a slowdown), got {self.factor}")


def parse_slowdown(text: str) -> Slowdown:
    """``RANK:FACTOR@STEP`` (``@STEP`` optional) -> Slowdown."""
    try:
        head, _, step = text.partition("@")
        rank, factor = head.split(":")
        return Slowdown(int(rank), float(factor), int(step) if step else 0)
    except UserError:
        raise
    except ValueError:
        raise UserError(f"slowdown '{text}' must look like RANK:FACTOR@STEP, e.g. 3:2.0@10") from None


def relative_speeds(plan: Plan) -> dict[str, float]:
    """Device type -> relative speed (fastest in the plan = 1.0).

    From ``emulation.speeds`` where a re-plan pinned the emulated devices (``pinned_emulation``), else
    ``plan.extra["device_speeds"]`` (the planner writes it), else from the GPU catalog's achievable FLOP/s of
    each device id in the plan.
    """
    types = sorted({s.device for p in plan.pipelines for s in p.stages})
    section = plan.extra.get("emulation")
    pinned = section.get("speeds") if isinstance(section, Mapping) else None
    given = pinned if isinstance(pinned, Mapping) else plan.extra.get("device_speeds")
    if isinstance(given, Mapping):
        missing = [t for t in types if t not in given]
        if missing:
            raise UserError(f"plan field 'device_speeds' has no speed for device type '{missing[0]}'")
        raw = {t: float(given[t]) for t in types}
    else:
        from ethpipe.catalog import get_gpu

        try:
            raw = {t: get_gpu(t).achievable_flops for t in types}
        except UserError:
            raise UserError(
                "--emulate needs relative device speeds: the plan has no 'device_speeds' field and its device "
                f"types ({', '.join(types)}) are not all GPU catalog ids; add \"device_speeds\": {{type: speed}}"
            ) from None
    if any(v <= 0 for v in raw.values()):
        raise UserError("plan field 'device_speeds' must hold positive speeds")
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
        raise UserError("auto_time_scale needs at least one core and one rank")
    return max(1.0, sum(rank_speeds) / (CPU_SHARE * num_cores))


def emulation_time_scale(plan: Plan, num_cores: int | None = None) -> float:
    """The plan's ``emulation.time_scale`` if given, else ``auto_time_scale`` for its world on this machine."""
    section = plan.extra.get("emulation")
    if section is not None:
        if not isinstance(section, Mapping):
            raise UserError("plan field 'emulation' must be an object like {\"time_scale\": 4.0}")
        given = section.get("time_scale")
        if given is not None:
            if isinstance(given, bool) or not isinstance(given, (int, float)) or given < 1.0:
                raise UserError(f"plan field 'emulation.time_scale' must be a number >= 1, got {given!r}")
            return float(given)
    speeds = relative_speeds(plan)
    rank_speeds = [speeds[stage.device] for pipe in plan.pipelines for stage in pipe.stages for _ in stage.ranks]
    return auto_time_scale(rank_speeds, num_cores if num_cores is not None else local_cores())


def _key_order(key: int | str) -> tuple[int, int]:
    """A target's key: micro-batch size ``b`` (a stage, or chunk 0 of an interleaved one) or ``"b.c"`` (chunk c)."""
    size, _, chunk = str(key).partition(".")
    return int(size), int(chunk or 0)


def with_emulation(plan: Plan, time_scale: float,
                   compute_s: Mapping[int, Mapping[int | str, tuple[float, ...]]] | None = None,
                   profiles: Mapping[str, Any] | None = None) -> Plan:
    """A copy of ``plan`` that pins the emulation time scale and, if given, paced targets
    (rank -> micro-batch size, or "size.chunk" for an interleaved stage's chunk c >= 1 -> (fwd_s, bwd_s[,
    wgrad_s])), so a prediction and a run agree on them; or
    ``profiles`` (device type -> MeasuredProfile of the emulated device), from which any plan's targets follow:
    what a plan re-made for the same emulated devices (`--replan-after`) is paced with."""
    emulation: dict[str, Any] = {"time_scale": float(time_scale)}
    if compute_s is not None:
        emulation["compute_s"] = {str(r): {str(b): [float(v) for v in times]
                                           for b, times in sorted(t.items(), key=lambda kv: _key_order(kv[0]))}
                                  for r, t in sorted(compute_s.items())}
    if profiles is not None:
        emulation["profiles"] = {t: p.to_dict() for t, p in sorted(profiles.items())}
    return dataclasses.replace(plan, extra={**plan.extra, "emulation": emulation})


def pinned_emulation(plan: Plan) -> dict[str, Any]:
    """``plan``'s emulated devices, for a plan re-made for them: the time scale and speeds they ran at (a re-plan's
    own speeds may come from a fit of the run, which must not change the emulated hardware) and their profiles;
    not the per-rank targets, which were the old stages'."""
    section = plan.extra.get("emulation")
    kept = {k: v for k, v in section.items() if k != "compute_s"} if isinstance(section, Mapping) else {}
    return {**kept, "time_scale": emulation_time_scale(plan), "speeds": relative_speeds(plan)}


def emulation_profiles(plan: Plan) -> dict[str, Any] | None:
    """The emulated devices' profiles the plan carries (``with_emulation(profiles=...)``), else None."""
    from ethpipe.cost.profile import profile_from_dict

    section = plan.extra.get("emulation")
    raw = section.get("profiles") if isinstance(section, Mapping) else None
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise UserError("plan field 'emulation.profiles' must map device types to profiles")
    return {str(t): profile_from_dict(p) for t, p in raw.items()}


def pacing_targets(plan: Plan, cost: Any) -> dict[int, dict[int | str, tuple[float, float, float]]]:
    """rank -> micro-batch size -> (fwd_s, bwd_s, wgrad_s) of its stage under ``cost`` (a CostModel): the
    simulator's compute times, which a paced run's actions last (a split backward's B lasts bwd - wgrad). An
    interleaved stage: size for chunk 0, ``"size.c"`` for chunk c (each chunk priced as the simulator does)."""
    out: dict[int, dict[int | str, tuple[float, float, float]]] = {}
    for pipe in plan.pipelines:
        v = pipe.depth * pipe.num_chunks
        for s, stage in enumerate(pipe.stages):
            times: dict[int | str, tuple[float, float, float]] = {}
            for c in range(pipe.num_chunks):
                part, vs = (stage.chunk(c) if pipe.num_chunks > 1 else stage), c * pipe.depth + s
                first, last = vs == 0, vs == v - 1
                for b in sorted(set(pipe.micro_batch_sizes)):
                    times[b if c == 0 else f"{b}.{c}"] = (*cost.stage_compute_s(part, b, first=first, last=last),
                                                          cost.weight_grad_s(part, b, first=first, last=last))
            for rank in stage.ranks:
                out[rank] = times
    return out


Target = tuple[int | str, float, float, float]  # (micro-batch size, or "size.chunk"; fwd_s, bwd_s, wgrad_s)


def _profile_targets(plan: Plan, rank: int, profiles: Mapping[str, Any]) -> tuple[Target, ...]:
    """The targets of ``rank``'s stage from the emulated devices' profiles (fp32 activations, as emulated runs)."""
    from ethpipe.cost.model import CostModel

    cost = CostModel(plan.active_cluster(), plan.resolve_model(), plan.seq_len, dtype_bytes=4, dtype="fp32",
                     profiles=profiles)
    return tuple((b, *times) for b, times in pacing_targets(plan, cost)[rank].items())


def paced_targets(plan: Plan, rank: int) -> tuple[Target, ...]:
    """``(micro_batch, fwd_s, bwd_s, wgrad_s)`` targets of ``rank`` from the plan's ``emulation.compute_s``, else
    from its ``emulation.profiles`` (or ()); an interleaved stage's chunk c >= 1 under ``"micro_batch.c"``.
    ``wgrad_s`` (a split backward's W) may be left out where the rank's stage never splits its backward."""
    section = plan.extra.get("emulation")
    table = section.get("compute_s") if isinstance(section, Mapping) else None
    if table is None:
        profiles = emulation_profiles(plan)
        return _profile_targets(plan, rank, profiles) if profiles else ()
    where = "plan field 'emulation.compute_s'"
    if not isinstance(table, Mapping) or str(rank) not in table or not isinstance(table[str(rank)], Mapping):
        raise UserError(f"{where} has no targets for rank {rank}: "
                        "give {\"RANK\": {\"MICRO_BATCH\": [fwd_s, bwd_s, wgrad_s]}}")
    pos = plan.position_of(rank)
    pipe = plan.pipelines[pos.pipeline]
    splits = any(a.kind == "W" for a in actions_of(pipe, pos.stage))
    needed = {b if c == 0 else f"{b}.{c}" for b in pipe.micro_batch_sizes for c in range(pipe.num_chunks)}
    out: list[Target] = []
    for key, times in table[str(rank)].items():
        try:
            values = [float(v) for v in times]
            size, chunk = _key_order(key)
        except (TypeError, ValueError):
            raise UserError(f"{where}[{rank}][{key}] must be [fwd_s, bwd_s, wgrad_s]") from None
        if len(values) not in (2, 3) or (splits and len(values) != 3):
            need = "[fwd_s, bwd_s, wgrad_s] (its stage splits its backward)" if splits else "[fwd_s, bwd_s]"
            raise UserError(f"{where}[{rank}][{key}] must be {need}")
        if min(values) < 0 or (len(values) == 3 and values[2] > values[1]):
            raise UserError(f"{where}[{rank}][{key}] must not be negative, and wgrad_s is part of bwd_s")
        out.append((size if chunk == 0 else f"{size}.{chunk}", values[0], values[1],
                    values[2] if len(values) == 3 else 0.0))
    missing = needed - {key for key, *_ in out}
    if missing:
        first = min(missing, key=_key_order)
        what = f"micro-batch size {first}" if isinstance(first, int) else f"chunk {_key_order(first)[1]} at " \
            f"micro-batch size {_key_order(first)[0]} (key \"{first}\")"
        raise UserError(f"{where}[{rank}] has no target for {what}")
    return tuple(sorted(out, key=lambda t: _key_order(t[0])))


def check_emulation(plan: Plan) -> None:
    """Every check ``--emulate`` makes of a plan (speeds, time scale, paced targets), before any process starts."""
    relative_speeds(plan)
    emulation_time_scale(plan, num_cores=1)
    for rank in range(plan.world_size):
        paced_targets(plan, rank)


@dataclass(frozen=True)
class Emulator:
    """One rank's emulated device: ``pace`` is called after each forward/backward."""

    speed: float  # relative to the fastest device type in the plan
    time_scale: float = 1.0  # every device runs this many times slower than the real one
    slowdowns: tuple[Slowdown, ...] = ()
    paced: tuple[Target, ...] = ()  # (micro_batch or "micro_batch.chunk", fwd_s, bwd_s, wgrad_s), if paced

    def slowdown(self, step: int) -> float:
        factor = 1.0
        for s in self.slowdowns:
            if step >= s.from_step:
                factor *= s.factor
        return factor

    def target_s(self, kind: str, micro_batch: int, compute_s: float, step: int, chunk: int = 0) -> float:
        """Emulated duration of a forward (``kind`` "F"), whole backward ("B"), or a split backward's input
        ("B-input") or weight ("W") pass of model chunk ``chunk`` whose real compute took ``compute_s``."""
        key = micro_batch if chunk == 0 else f"{micro_batch}.{chunk}"
        for size, fwd, bwd, wgrad in self.paced:
            if size == key:
                target = {"F": fwd, "B": bwd, "B-input": bwd - wgrad, "W": wgrad}[kind]
                return target * self.slowdown(step)
        return compute_s * self.time_scale * self.slowdown(step) / self.speed

    def sleep_s(self, kind: str, micro_batch: int, compute_s: float, elapsed_s: float, step: int,
                chunk: int = 0) -> float:
        """Sleep that makes an action that has lasted ``elapsed_s`` of wall time last its target."""
        return max(0.0, self.target_s(kind, micro_batch, compute_s, step, chunk) - elapsed_s)

    def pace(self, kind: str, micro_batch: int, compute_s: float, elapsed_s: float, step: int, chunk: int = 0) -> float:
        """Sleep up to the action's target duration; returns the sleep."""
        sleep = self.sleep_s(kind, micro_batch, compute_s, elapsed_s, step, chunk)
        if sleep > 0:
            time.sleep(sleep)
        return sleep


def check_emulate_mode(mode: str) -> None:
    if mode not in EMULATE_MODES:
        raise UserError(f"--emulate-mode must be {' or '.join(EMULATE_MODES)}, got {mode!r}")


def make_emulator(plan: Plan, rank: int, slowdowns: tuple[Slowdown, ...] = (),
                  num_cores: int | None = None, mode: EmulateMode = "paced") -> Emulator:
    """Rank ``rank``'s emulator; ``mode="measured"`` ignores the plan's paced targets (see the module docstring)."""
    check_emulate_mode(mode)
    for s in slowdowns:
        if not 0 <= s.rank < plan.world_size:
            raise UserError(f"slowdown rank {s.rank} is not in the plan (world size {plan.world_size})")
    pos = plan.position_of(rank)
    device = plan.pipelines[pos.pipeline].stages[pos.stage].device
    paced = paced_targets(plan, rank) if mode == "paced" else ()
    return Emulator(relative_speeds(plan)[device], emulation_time_scale(plan, num_cores),
                    tuple(s for s in slowdowns if s.rank == rank), paced)
