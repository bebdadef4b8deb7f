"""Whether to shard the optimizer state across pipelines (ZeRO-1, ``runtime/sync/zero.py``), and the plan that uses it.

Sharding divides each block's AdamW moments (8 of the 16 bytes per parameter) over its holders, one rank
per pipeline, so a plan's memory depends on its own number of pipelines k, which the search chooses. The
planner solves that by iteration: plan with the moments priced at 1 / k (k first from the unsharded
plan, at least 2); a plan with P >= k pipelines is valid (its moments take 1 / P <= 1 / k: the price was
conservative) and is kept, re-priced at its own k = P; P != k re-plans at k = P (P > k: more memory freed
may allow a better plan) until P = k or ``MAX_ROUNDS``; each round prunes against the unsharded plan (so the next
one can be searched ahead, in a second process: ``with_sharding``). The cheaper of the unsharded plan and the best
valid sharded one wins:
sharding costs time (the sync becomes a reduce and, after the optimizer, an all-gather: ``CostModel.sync_s``)
and pays where the memory it frees buys fewer stages, less recompute or larger micro-batches.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from ethpipe.cost.model import CostModel
from ethpipe.errors import Infeasible
from ethpipe.plan import Plan
from ethpipe.planner.estimate import estimate_plan
from ethpipe.planner.predicted import predicted_metrics
from ethpipe.planner.devices.idle import AHEAD_MIN_DEVICES, compared_time_s, sub_cluster
from ethpipe.planner.search.ahead import MISSING, Ahead, can_run_ahead
from ethpipe.planner.search.incumbent import incumbent_bar_s

MAX_ROUNDS = 4  # the fixpoint settles in 1-2 rounds on every evaluation case (docs/evaluation.md)
# The rounds search every device too where the unsharded plan on every device was at most this much slower than
# the one with devices idle (or did not fit), and likewise an idle candidate whose unsharded plan was: sharding's
# freed memory moved such plans by 1-15% on the measured cases (docs/runtime.md, "Optimizer sharding"), and each
# such search costs as much as a round again.
EVERY_DEVICE_WITHIN = 1.25

PlanFn = Callable[[CostModel], tuple[Plan, CostModel]]
RefineFn = Callable[[CostModel, float], "Plan | None"]
FinishFn = Callable[[Plan, CostModel, bool], Plan]  # (plan, its cost model, with the dear passes too)


def with_sharding(cost: CostModel, plan_fn: PlanFn, flat_sync: bool, robust: bool = False,
                  refine_fn: RefineFn | None = None, *, ahead: bool | None = None,
                  finish_fn: FinishFn | None = None) -> tuple[Plan, CostModel]:
    """The faster of ``plan_fn(cost)`` unsharded and sharded (module docstring); the plan records which, and why.
    ``finish_fn(plan, cost, full)``: what the caller does to the chosen plan afterwards (``planner.make_plan``:
    interleaving, then sub-layer cuts; ``full`` False: the cuts alone), done before the unsharded plan and the best
    sharded one are compared (``_finished``), so the choice is the faster finished plan.
    ``robust``: compared by their worst cases (``planner/robust.py``), as the robust search compares plans.
    ``refine_fn(cost, incumbent_s)``: one search on ``cost``'s devices that returns None unless it beats
    ``incumbent_s``; where given, the sharded rounds search the devices the unsharded plan chose and the device
    sets that came near it unsharded (``_other_device_sets``: every device, an idle candidate's), pruning against
    its time, which keeps planning time near
    one search where sharding does not pay. Without it (or where nothing fits unsharded) each round is a whole
    ``plan_fn``.
    Every refined round prunes against the unsharded plan, so a round depends on the ones before it only
    through its k: with ``ahead`` (default: from ``AHEAD_MIN_DEVICES`` devices, where ``can_run_ahead()``)
    the round at 2k, the fixpoint's usual next step, is searched in a second process while this one
    searches k. Its result is used only if the round at k asks for 2k, so the plan never depends on it."""
    started = time.perf_counter()
    plain: tuple[Plan, CostModel] | None = None
    error: Infeasible | None = None
    try:
        plain = plan_fn(cost)
    except Infeasible as err:
        error = err
    k = max(len(plain[0].pipelines), 2) if plain is not None else 2
    if ahead is None:
        ahead = cost.cluster.num_devices >= AHEAD_MIN_DEVICES
    rounds = (_Rounds(plain, refine_fn, robust, ahead and can_run_ahead(), _other_device_sets(cost, plain))
              if plain is not None and refine_fn else None)
    tried: list[int] = []
    best: tuple[Plan, CostModel] | None = None
    try:
        for _ in range(MAX_ROUNDS):
            if k in tried or k > cost.cluster.num_devices:
                break
            tried.append(k)
            try:
                if rounds is not None:
                    found = rounds.search(k, ahead_k=2 * k if 2 * k <= cost.cluster.num_devices else None)
                    if found is None:
                        break  # nothing sharded beats the unsharded plan at this k
                    plan, on = found[0], rounds.cost_at(k, found[1])
                else:
                    plan, on = plan_fn(cost.with_optimizer_holders(k))
            except Infeasible:
                break
            num_pipelines = len(plan.pipelines)
            if num_pipelines == k:  # priced exactly as it will run
                found = (dataclasses.replace(plan, shard_optimizer=True), on)
            elif num_pipelines > k:  # valid (its moments take less than priced): re-priced at its own k
                found = _repriced(plan, on.with_optimizer_holders(num_pipelines), flat_sync, robust)
            else:
                found = None
            if found is not None and (best is None or _score(found[0], robust) < _score(best[0], robust)):
                best = found
            if num_pipelines < 2 or num_pipelines == k:
                break
            k = num_pipelines
    finally:
        if rounds is not None:
            rounds.close()
    if plain is None and best is None:
        assert error is not None
        raise error
    if finish_fn is not None and not robust:
        plain, best = _finished(plain, best, finish_fn, flat_sync)
    use_best = plain is None or (best is not None and _score(best[0], robust) < _score(plain[0], robust))
    choice = best if use_best else plain
    assert choice is not None
    record = {"chosen": choice[0].shard_optimizer, "holders_tried": tried,
              "unsharded_iteration_s": _time_s(plain[0]) if plain is not None else None,
              "sharded_iteration_s": _time_s(best[0]) if best is not None else None,
              "sharding_search_s": time.perf_counter() - started}
    search = {**choice[0].extra.get("search", {}), "shard_optimizer": record}
    predicted = {**choice[0].predicted, "planning_time_s": time.perf_counter() - started}  # both searches
    plan = dataclasses.replace(choice[0], extra={**choice[0].extra, "search": search}, predicted=predicted)
    return plan, choice[1]


# Finishing (interleaving, sub-layer cuts) gained at most 12% on the measured plans (llama2-13b on 32 V100-32:
# 17.14 -> 15.08 s interleaved; sub-layer cuts <= 8% on planner_random): a plan slower than the other one finished
# by more than this is not finished just to lose.
FINISH_GAIN_BOUND = 1.15


def _finished(plain: tuple[Plan, CostModel] | None, best: tuple[Plan, CostModel] | None, finish_fn: FinishFn,
              flat_sync: bool = False) -> tuple[tuple[Plan, CostModel] | None, tuple[Plan, CostModel] | None]:
    """The unsharded plan and the best sharded one as they are compared: the faster one finished; the other, where
    finishing could make it win (``FINISH_GAIN_BOUND``), cut inside layers (the cheap pass), and finished whole only
    where that could win: cut, or with its bubble closed (``_bubble_free_s``: what interleaving reaches at best).
    Interleaving every such plan cost 1.2x planning time on planner_random; never interleaving it left a 4-stage
    1F1B pipeline (llama2-13b, 16 samples, 8 H100 + 8 RTX 3090) at 1.93 s where interleaved it took 1.78 s,
    and the plan 1.88 s."""
    pair = [plain, best]
    order = sorted((i for i in (0, 1) if pair[i] is not None), key=lambda i: _time_s(pair[i][0]))  # type: ignore[index]
    first, *rest = order
    plan, on = pair[first]  # type: ignore[misc]
    pair[first] = (finish_fn(plan, on, True), on)
    done_s = _time_s(pair[first][0])  # type: ignore[index]
    for i in rest:
        plan, on = pair[i]  # type: ignore[misc]
        if _time_s(plan) < FINISH_GAIN_BOUND * done_s:
            cut = finish_fn(plan, on, False)
            pair[i] = (finish_fn(plan, on, True) if _bubble_free_s(cut, on, flat_sync) < done_s else cut, on)
    return pair[0], pair[1]


def _bubble_free_s(plan: Plan, cost: CostModel, flat_sync: bool = False) -> float:
    """``plan``'s price with every pipeline's fill and drain closed: its iteration less the slowest flush, plus the
    busiest rank's compute (interleaving shortens the bubble, not a rank's work); at most the plan's own time."""
    est = estimate_plan(plan, cost, flat_sync=flat_sync)
    return est.iteration_time_s - est.makespan_s + max(est.busy_s.values(), default=est.makespan_s)


class _Rounds:
    """The refined rounds (``refine_fn`` on the unsharded plan's devices, pruned against its time; and on each of
    ``others``' device sets: ``_other_device_sets``), each searched once, the next one possibly ahead in a second
    process (``with_sharding``). A round's result: its plan, and which device set it runs on (0: the unsharded
    plan's, i: ``others[i - 1]``)."""

    def __init__(self, plain: tuple[Plan, CostModel], refine_fn: RefineFn, robust: bool, ahead: bool,
                 others: tuple[_DeviceSet, ...] = ()) -> None:
        self.plain, self.refine_fn, self.ahead, self.robust, self.others = plain, refine_fn, ahead, robust, others
        self.bar_s = math.inf if robust else incumbent_bar_s(plain[0], _score(plain[0], robust))
        self.pending: tuple[int, Ahead] | None = None

    def cost_at(self, k: int, device_set: int = 0) -> CostModel:
        on = self.others[device_set - 1].cost if device_set else self.plain[1]
        return on.with_optimizer_holders(k)

    def _run(self, k: int) -> tuple[Plan, int] | None:
        """The round at k; raises the unsharded plan's devices' ``Infeasible`` where no device set fits."""
        error: Infeasible | None = None
        try:
            found = self.refine_fn(self.cost_at(k), self.bar_s)
        except Infeasible as err:
            found, error = None, err
        out = None if found is None else (_with_idle_record(found, self.plain[0]), 0)
        best = found
        # Each other device set, pruned against the best so far (the unsharded plan or a round); kept only if faster
        # (robust: no pruning, the lower worst case; ties keep the unsharded plan's devices).
        for i, other in enumerate(self.others, start=1):
            bar_s = self.bar_s if best is None or self.robust else min(
                self.bar_s, incumbent_bar_s(best, _score(best, self.robust)))
            try:
                wide = self.refine_fn(self.cost_at(k, i), bar_s)
            except Infeasible:  # nothing fits there at k (robust, or pipelines that must mix): the others stand
                continue
            error = None
            if wide is not None and (best is None or _score(wide, self.robust) < _score(best, self.robust)):
                out = (other.record(wide, self.plain[0], best), i)
                best = wide
        if error is not None:
            raise error
        return out

    def search(self, k: int, ahead_k: int | None) -> tuple[Plan, int] | None:
        """The round at k (raises ``Infeasible`` as ``refine_fn`` does); the round at ``ahead_k`` starts alongside."""
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] != k:
            pending[1].cancel()
            pending = None
        if pending is None and self.ahead and ahead_k is not None:
            self.pending = (ahead_k, Ahead(lambda: self._run(ahead_k)))
        out = pending[1].result() if pending is not None else MISSING
        return self._run(k) if out is MISSING else out

    def close(self) -> None:
        if self.pending is not None:
            self.pending[1].cancel()
            self.pending = None


@dataclasses.dataclass(frozen=True)
class _DeviceSet:
    """Devices other than the unsharded plan's that the sharded rounds also search: every device (``idle_types``
    empty) or an idle candidate's sub-cluster, with the unsharded time that made it worth a round."""

    cost: CostModel
    idle_types: tuple[str, ...]
    unsharded_s: float | None  # None: no unsharded plan fitted on these devices

    def record(self, plan: Plan, plain: Plan, beaten: Plan | None) -> Plan:
        if not self.idle_types:
            return _on_every_device(plan, plain)
        return _on_idle_candidate(plan, plain, self, beaten)


def _other_device_sets(cost: CostModel, plain: tuple[Plan, CostModel]) -> tuple[_DeviceSet, ...]:
    """The device sets the sharded rounds search besides the unsharded plan's: the idle choice was made under
    unsharded memory, and the memory sharding frees can change it either way. Every device of ``cost``, where the
    unsharded plan leaves some idle and its plan on every device was at most ``EVERY_DEVICE_WITHIN`` slower (or did
    not fit); and the fastest other idle candidate whose unsharded time is known (it beat the plan before it, or
    came within ``idle.NEAR``) and was at most ``EVERY_DEVICE_WITHIN`` slower. Sets are compared by their devices
    (``Cluster.device_indices``), so none is searched twice."""
    record = plain[0].extra.get("search", {}).get("idle") or {}
    bar_s = EVERY_DEVICE_WITHIN * compared_time_s(plain[0])  # as the idle search compared (robust: worst cases)
    mine = plain[1].cluster.device_indices
    out = []
    every_s = record.get("full_cluster_iteration_time_s")
    if cost.cluster.device_indices != mine and (every_s is None or every_s <= bar_s):
        out.append(_DeviceSet(cost, (), every_s))
    known = sorted((t, tuple(c["idle_types"])) for c in record.get("candidates", ())
                   if (t := c.get("worst_case_time_s", c.get("iteration_time_s", c.get("near_s")))) is not None
                   and t <= bar_s)
    for time_s, idle_types in known:
        sub = sub_cluster(cost, idle_types)
        if sub.cluster.device_indices != mine:
            out.append(_DeviceSet(sub, idle_types, time_s))
            break
    return tuple(out)


def _with_idle_record(plan: Plan, plain: Plan) -> Plan:
    """A plan searched on the unsharded plan's devices carries that plan's idle devices and the idle search's
    record (also where it left none idle: which candidates it tried and why they lost)."""
    record = plain.extra.get("search", {}).get("idle")
    if not plain.idle_devices and record is None:
        return plan
    search = {**plan.extra.get("search", {}), **({"idle": record} if record is not None else {})}
    return dataclasses.replace(plan, idle_devices=plain.idle_devices, extra={**plan.extra, "search": search})


def _with_idle_note(plan: Plan, plain: Plan, key: str, note: str) -> Plan:
    """``plan`` with the unsharded plan's idle search record, plus ``note`` under ``key``: why the sharded rounds
    changed which devices run."""
    record = {**(plain.extra.get("search", {}).get("idle") or {}), key: note}
    return dataclasses.replace(plan, extra={**plan.extra, "search": {**plan.extra.get("search", {}), "idle": record}})


def _on_every_device(plan: Plan, plain: Plan) -> Plan:
    """A sharded plan on every device where the unsharded one left some idle: why those devices run after all."""
    return _with_idle_note(plan, plain, "sharded_uses_every_device", "sharded, the devices the unsharded plan left "
                           f"idle pay: {len(plain.idle_devices)} devices run")


def _on_idle_candidate(plan: Plan, plain: Plan, devices: _DeviceSet, beaten: Plan | None) -> Plan:
    """A sharded plan on an idle candidate's devices other than the unsharded plan's: its idle devices say why,
    and the idle search's record that the sharded rounds changed its choice."""
    names = ", ".join(devices.idle_types)
    with_s = min([compared_time_s(plain)] + ([compared_time_s(beaten)] if beaten is not None else []))
    what = "worst case" if "worst_case_time_s" in (plan.predicted or {}) else "predicted"
    # the plan's own time is the one it is re-priced at (``_repriced``): not quoted here
    reason = f"idle: sharded, the plan without {names} beats the best other plan searched ({what} {with_s:.4g} s)"
    idle = tuple(dataclasses.replace(d, reason=reason) for d in plan.idle_devices)
    return _with_idle_note(dataclasses.replace(plan, idle_devices=idle), plain, "sharded_idles",
                           f"sharded, idling {names} pays: {len(plan.idle_devices)} devices idle "
                           f"(unsharded, that plan took {devices.unsharded_s:.4g} s)")


def _repriced(plan: Plan, cost: CostModel, flat_sync: bool, robust: bool) -> tuple[Plan, CostModel]:
    plan = dataclasses.replace(plan, shard_optimizer=True)
    predicted = predicted_metrics(plan, cost, plan.predicted.get("planning_time_s", 0.0), flat_sync=flat_sync)
    if robust:
        from ethpipe.planner.robust import robust_record

        predicted.update(robust_record(plan, cost))
    return dataclasses.replace(plan, predicted=predicted), cost


def _score(plan: Plan, robust: bool) -> float:
    return float(plan.predicted["worst_case_time_s"]) if robust else _time_s(plan)


def _time_s(plan: Plan) -> float:
    return float(plan.predicted["iteration_time_s"])
