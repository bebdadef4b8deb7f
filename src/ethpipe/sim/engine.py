"""Discrete-event replay of one training iteration of a Plan.

Each stage replays exactly the action list the runtime executes (``ethpipe.schedule``, the
pipeline's own schedule), on one stream: ``F j`` on a non-first stage first receives micro-batch j's
activation from the previous stage, ``B j`` on a non-last stage the gradient from the next; a split
``B`` lasts the backward less its weight gradients, ``W`` those (``TimingModel.weight_grad_s``). Receives are blocking
rendezvous, as in the runtime: the transfer (p2p time on that link) starts once the sender has
produced the tensor and the receiver has reached the action, and occupies the receiver; sends
are asynchronous and cost the sender nothing. After a stage's last backward its blocks'
gradients are all-reduced on a per-stage communication stream in the runtime's order (blocks descending,
the tied matrix last), each all-reduce starting once every holder is free; then each stage steps its
optimizer.
With ``flat_sync`` every all-reduce waits for the slowest pipeline to flush (DDP-style).

Stages are advanced in alternating sweeps (forward chains resolve in ascending sweeps,
backward chains in descending ones), so the cost is linear in the number of actions; a tp>1
stage is one stream whose events carry all its ranks.
"""

from __future__ import annotations

from ethpipe.cost.plan_memory import stage_peak_bytes
from ethpipe.cost.sync import block_sync_order, holder_stages, tied_holder_stages
from ethpipe.plan import Plan
from ethpipe.schedule import input_source, output_dest, pipeline_actions, split_microbatches
from ethpipe.sim.report import EventKind, RankStats, SimEvent, SimReport
from ethpipe.sim.timing import TimingModel

_NO_EVENT = -1


class _Recorder:
    """Append-only event store with each event's binding predecessor (for the critical path)."""

    def __init__(self) -> None:
        self.events: list[SimEvent] = []
        self.preds: list[int] = []

    def add(self, event: SimEvent, pred: int) -> int:
        self.events.append(event)
        self.preds.append(pred)
        return len(self.events) - 1

    def critical_path(self, last: int) -> tuple[SimEvent, ...]:
        path = []
        while last != _NO_EVENT:
            path.append(self.events[last])
            last = self.preds[last]
        return tuple(reversed(path))


def _simulate_pipeline(
    plan: Plan, p: int, cost: TimingModel, rec: _Recorder,
) -> tuple[list[float], list[int], list[float], list[float]]:
    """Replay one pipeline's schedule; per stage: flush time, last event id, compute s, receive s."""
    pipe = plan.pipelines[p]
    stages, sizes = pipe.stages, pipe.micro_batch_sizes
    num_stages, num_chunks = len(stages), pipe.num_chunks
    schedules = pipeline_actions(pipe)
    split = [split_microbatches(actions) for actions in schedules]
    # (stage, chunk, size) -> (F, whole B, input-only B, W) seconds
    durations: dict[tuple[int, int, int], tuple[float, float, float, float]] = {}
    for s, stage in enumerate(stages):
        for c in range(num_chunks):
            part = stage.chunk(c) if num_chunks > 1 else stage
            first, last = s == 0 and c == 0, s == num_stages - 1 and c == num_chunks - 1
            for size in set(sizes):
                fwd, bwd = cost.stage_compute_s(part, size, first=first, last=last)
                moved = cost.weight_grad_s(part, size, first=first, last=last) if split[s] else 0.0
                durations[(s, c, size)] = (fwd, bwd, bwd - moved, moved)
    heads = [st.ranks[0] for st in stages]
    p2p_cache: dict[tuple[int, int, int], float] = {}

    def p2p(src: int, dst: int, size: int) -> float:
        key = (src, dst, size)
        if key not in p2p_cache:
            p2p_cache[key] = cost.p2p_s(src, dst, size)
        return p2p_cache[key]

    # ready[(kind, stage, micro-batch, chunk)] = (time, event id) when that action's input is ready at its sender.
    ready: dict[tuple[str, int, int, int], tuple[float, int]] = {}
    free = [0.0] * num_stages
    last_event = [_NO_EVENT] * num_stages
    busy = [0.0] * num_stages
    recv = [0.0] * num_stages
    pos = [0] * num_stages
    remaining = sum(len(a) for a in schedules)
    ascending = True
    while remaining:
        progressed = False
        order = range(num_stages) if ascending else range(num_stages - 1, -1, -1)
        for s in order:
            actions = schedules[s]
            ranks = stages[s].ranks
            while pos[s] < len(actions):
                action = actions[pos[s]]
                j, c, kind = action.microbatch, action.chunk, action.kind
                src, _ = input_source(kind, s, c, num_stages, num_chunks)
                start, pred = free[s], last_event[s]
                if src >= 0:
                    sent = ready.pop((kind, s, j, c), None)
                    if sent is None:
                        break
                    if sent[0] > start:
                        start, pred = sent
                    end = start + p2p(heads[src], heads[s], sizes[j])
                    pred = rec.add(SimEvent(f"recv {action}", "p2p", p, s, ranks, start, end, microbatch=j), pred)
                    recv[s] += end - start
                    start = end
                which = 0 if kind == "F" else 3 if kind == "W" else 2 if j in split[s] else 1
                dur = durations[(s, c, sizes[j])][which]
                end = start + dur
                ev = rec.add(SimEvent(str(action), "compute", p, s, ranks, start, end, microbatch=j), pred)
                free[s], last_event[s] = end, ev
                busy[s] += dur
                dst, dc = output_dest(kind, s, c, num_stages, num_chunks)
                if dst >= 0:
                    ready[(kind, dst, j, dc)] = (end, ev)
                pos[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, "the action lists deadlocked: schedule and simulator disagree"
        ascending = not ascending
    return free, last_event, busy, recv


def _collectives(plan: Plan, rec: _Recorder, kind: EventKind, items: list[tuple[str, int, list[tuple[int, int]], float]],
                 free: dict[tuple[int, int], float], tail: dict[tuple[int, int], int]) -> None:
    """Each collective in order starts when its last holder stage is free and occupies every holder stage
    (``free`` / ``tail``: each stage's stream end and its last event, updated in place)."""
    for label, k, holders, dur in items:
        if dur <= 0.0:
            continue
        binding = max(holders, key=lambda key: free[key])
        start, pred = free[binding], tail[binding]
        for key in holders:
            ranks = plan.pipelines[key[0]].stages[key[1]].ranks
            event = SimEvent(f"{kind} {label}", kind, key[0], key[1], ranks, start, start + dur, block=k)
            free[key], tail[key] = start + dur, rec.add(event, pred)

def simulate(plan: Plan, cost: TimingModel, *, flat_sync: bool = False) -> SimReport:
    """Simulate one iteration of ``plan`` priced by ``cost``."""
    with_p2p = getattr(cost, "with_plan_p2p", None)  # the real cost model: the plan's NIC sharing (cost/p2p.py)
    if with_p2p is not None:
        cost = with_p2p(plan)
    rec = _Recorder()
    flush: dict[tuple[int, int], float] = {}
    tail: dict[tuple[int, int], int] = {}
    busy: dict[tuple[int, int], float] = {}
    recv: dict[tuple[int, int], float] = {}
    for p in range(len(plan.pipelines)):
        free, last_event, stage_busy, stage_recv = _simulate_pipeline(plan, p, cost, rec)
        for s in range(len(free)):
            key = (p, s)
            flush[key], tail[key], busy[key], recv[key] = free[s], last_event[s], stage_busy[s], stage_recv[s]

    slowest = max(flush, key=lambda key: flush[key])
    comm_free = {key: (flush[slowest] if flat_sync else t) for key, t in flush.items()}
    comm_tail = {key: (tail[slowest] if flat_sync else ev) for key, ev in tail.items()}
    holders_of, durations = holder_stages(plan), cost.block_sync_s(plan)
    syncs = [(f"block {k}", k, holders_of[k], durations[k]) for k in block_sync_order(len(plan.blocks))]
    tied_s = cost.tied_sync_s(plan)  # the runtime's order: blocks descending, the tied matrix last
    syncs += [("tied", -1, tied_holder_stages(plan), tied_s)] if tied_s > 0 else []
    _collectives(plan, rec, "allreduce", syncs, comm_free, comm_tail)

    opt_end: dict[tuple[int, int], float] = {}
    opt_start: dict[tuple[int, int], float] = {}
    opt_event: dict[tuple[int, int], int] = {}
    no_sync_end = 0.0
    for (p, s), t_flush in flush.items():
        pipe = plan.pipelines[p]
        stage = pipe.stages[s]
        dur = cost.optimizer_s(stage, first=s == 0, last=s == pipe.depth - 1)
        start, pred = t_flush, tail[(p, s)]
        if comm_free[(p, s)] > start:
            start, pred = comm_free[(p, s)], comm_tail[(p, s)]
        opt_start[(p, s)], opt_end[(p, s)] = start, start + dur
        opt_event[(p, s)] = rec.add(SimEvent("optimizer", "optimizer", p, s, stage.ranks, start, start + dur), pred)
        no_sync_end = max(no_sync_end, t_flush + dur)

    end, end_event = dict(opt_end), dict(opt_event)  # sharded: the all-gathers of the updated shards follow
    gathers = [("tied", -1, tied_holder_stages(plan), cost.tied_gather_s(plan))]
    gather_s = cost.block_gather_s(plan)
    gathers += [(f"block {k}", k, holders_of[k], gather_s[k]) for k in reversed(block_sync_order(len(plan.blocks)))]
    _collectives(plan, rec, "allgather", gathers, end, end_event)
    last_key = max(end, key=lambda key: end[key])
    iteration_s = end[last_key]
    stats = []
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            key = (p, s)
            memory = stage_peak_bytes(plan, cost, p, s)
            busy_s = busy[key] + opt_end[key] - opt_start[key]
            for r in stage.ranks:
                stats.append(RankStats(
                    rank=r, pipeline=p, stage=s, device=stage.device, busy_s=busy_s, idle_s=iteration_s - busy_s,
                    bubble_s=flush[key] - busy[key] - recv[key], recv_s=recv[key],
                    sync_wait_s=opt_start[key] - flush[key], flush_s=flush[key],
                    peak_memory_bytes=int(memory),
                ))
    stats.sort(key=lambda st: st.rank)
    pipeline_flush = tuple(max(flush[(p, s)] for s in range(pipe.depth)) for p, pipe in enumerate(plan.pipelines))
    return SimReport(
        iteration_time_s=iteration_s,
        tokens_per_s=plan.global_batch_size * plan.seq_len / iteration_s if iteration_s > 0 else 0.0,
        exposed_comm_s=max(iteration_s - no_sync_end, 0.0),
        flat_sync=flat_sync,
        pipeline_flush_s=pipeline_flush,
        ranks=tuple(stats),
        critical_path=rec.critical_path(end_event[last_key]),
        events=tuple(rec.events),
    )
