"""Discrete-event replay of one training iteration of a Plan.

Each stage replays exactly the action list the runtime executes (``ethpipe.schedule``, the
pipeline's own schedule), on one stream: ``F j`` on a non-first stage first receives micro-batch j's
activation from the previous stage, ``B j`` on a non-last stage the gradient from the next; a split
``B`` lasts the backward less its weight gradients, ``W`` those (``TimingModel.weight_grad_s``). Point-to-point
is the runtime's (``comm/program.py``; the graph of waits: ``cost/rendezvous.py``, which the planner's replay
prices too): the sends an action produces and the receives the next action needs are one batch, waited before
that next action. A transfer (p2p time on that link) is a rendezvous: it starts once the sender has produced
the tensor and the receiver has posted its receive (after its previous action), and both wait for it: the
receiver before the consuming action, the sender before its own next action (a send completes only when its
peer's receive runs; before a ``W``: before the action after it) and before its flush (its last sends). The
receives of the action after a run of ``W``s are posted before the Ws, with the deferred sends. A
transfer that takes no time costs its sender nothing. After a stage's last backward and sends its blocks'
gradients are all-reduced on a per-stage communication stream in the runtime's order (blocks descending,
the tied matrix last), each all-reduce starting once every holder is free; then, once the last stage's sync
is done, every rank joins the step's stats all-gather (the gradient norm the clipped optimizer needs) and
each stage steps its optimizer.
With ``flat_sync`` every all-reduce waits for the slowest pipeline to flush (DDP-style).

Stages are advanced in alternating sweeps (forward chains resolve in ascending sweeps,
backward chains in descending ones), so the cost is linear in the number of actions; a tp>1
stage is one stream whose events carry all its ranks.
"""

from __future__ import annotations

from ethpipe.cost.plan_memory import stage_peak_bytes
from ethpipe.cost.rendezvous import Node, stage_nodes
from ethpipe.cost.sync import block_sync_order, holder_stages, tied_holder_stages
from ethpipe.plan import Plan
from ethpipe.schedule import pipeline_actions, split_microbatches
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
    """Replay one pipeline's schedule; per stage: flush time (its last sends done), last event id, compute s,
    receive s. Nodes (``cost/rendezvous.py``) are advanced in alternating sweeps, each as far as what it waits
    for is known."""
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
            p2p_cache[key] = cost.p2p_s(heads[src], heads[dst], size)
        return p2p_cache[key]

    nodes = stage_nodes(schedules, num_chunks)
    # ends[s][n] = (time, event id) when stage s's node n ends: its compute, or, for a wait node, the wait.
    ends: list[list[tuple[float, int]]] = [[] for _ in range(num_stages)]
    busy = [0.0] * num_stages
    recv = [0.0] * num_stages

    def waits(s: int, node: Node, prev: tuple[float, int]
              ) -> tuple[list[tuple[int, float, float, int]], tuple[float, int]] | None:
        """The receives ``node`` waits for, (action, start, end, binding event) each, and the latest end of its
        waited sends' transfers (end, binding event); None while a neighbour has not got that far."""
        pairs = []  # (action, producer stage, its node, seconds)
        for r in node.recvs:  # the batch's: this action's, and a free one of a later action of the unit waits there
            dur = p2p(r.src, s, sizes[schedules[s][r.action].microbatch])
            if r.action == node.action or dur > 0.0:
                pairs.append((r.action, r.src, r.node, dur))
        if node.src is not None and all(r.action != node.action for r in node.recvs):
            dur = p2p(node.src[0], s, sizes[schedules[s][node.action].microbatch])
            if dur == 0.0:
                pairs.append((node.action, *node.src, dur))
        got = []
        posted = ends[s][node.posted] if node.posted >= 0 else (0.0, _NO_EVENT)  # the receiver's post: before a W run
        for k, src, at, dur in pairs:
            if len(ends[src]) <= at:
                return None
            start, pred = ends[src][at] if ends[src][at][0] > posted[0] else posted
            got.append((k, start, start + dur, pred))
        out = (-1.0, _NO_EVENT)
        for send in node.sends:
            dur = p2p(s, send.dst, sizes[schedules[s][send.action].microbatch])
            if dur == 0.0:  # free: its sender does not wait
                continue
            if send.post >= 0 and len(ends[send.dst]) <= send.post:
                return None
            post = ends[send.dst][send.post] if send.post >= 0 else (0.0, _NO_EVENT)
            start, pred = max(ends[s][send.posted], post, key=lambda x: x[0])
            if start + dur > out[0]:
                out = (start + dur, pred)
        return got, out

    ascending = True
    while any(len(ends[s]) < len(nodes[s]) for s in range(num_stages)):
        progressed = False
        order = range(num_stages) if ascending else range(num_stages - 1, -1, -1)
        for s in order:
            ranks = stages[s].ranks
            while len(ends[s]) < len(nodes[s]):
                n = len(ends[s])
                node = nodes[s][n]
                prev = ends[s][n - 1] if n else (0.0, _NO_EVENT)
                found = waits(s, node, prev)
                if found is None:
                    break
                got, out = found
                start, pred = prev
                if got:  # one event for the batch's receives (they run at once; posted before a W run: maybe done)
                    first, last = min(g[1] for g in got), max(got, key=lambda g: g[2])
                    name = "recv " + " ".join(str(schedules[s][g[0]]) for g in got)
                    event = SimEvent(name, "p2p", p, s, ranks, first, last[2],
                                     microbatch=schedules[s][last[0]].microbatch)
                    received = rec.add(event, last[3])
                    if last[2] >= start:
                        start, pred = last[2], received
                    recv[s] += max(0.0, last[2] - max(first, prev[0]))  # blocking: what the Ws did not hide
                if out[0] > start:  # the sender's wait, past its receives
                    sent = [str(schedules[s][x.action]) for x in node.sends]
                    event = SimEvent("send " + " ".join(sent), "p2p", p, s, ranks, start, out[0],
                                     microbatch=schedules[s][node.sends[-1].action].microbatch)
                    start, pred = out[0], rec.add(event, out[1])
                if node.action < 0:
                    ends[s].append((start, pred))
                else:
                    action = schedules[s][node.action]
                    j, c, kind = action.microbatch, action.chunk, action.kind
                    which = 0 if kind == "F" else 3 if kind == "W" else 2 if j in split[s] else 1
                    dur = durations[(s, c, sizes[j])][which]
                    ev = rec.add(SimEvent(str(action), "compute", p, s, ranks, start, start + dur, microbatch=j), pred)
                    ends[s].append((start + dur, ev))
                    busy[s] += dur
                progressed = True
        assert progressed, "the action lists deadlocked: schedule and simulator disagree"
        ascending = not ascending
    return [e[-1][0] for e in ends], [e[-1][1] for e in ends], busy, recv


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

    # The step's stats: one world-wide all-gather once every rank has synced (``runtime/step.py``); no optimizer
    # step starts before it.
    ready = {key: (comm_free[key], comm_tail[key]) if comm_free[key] > t else (t, tail[key]) for key, t in flush.items()}
    last = max(ready, key=lambda key: ready[key][0])
    barrier_s, barrier_event = ready[last]
    stats_s = cost.stats_gather_s(plan)
    stats_event = {key: barrier_event for key in flush}
    if stats_s > 0.0:
        for key in flush:
            p, s = key
            stats_event[key] = rec.add(SimEvent("allgather stats", "allgather", p, s, plan.pipelines[p].stages[s].ranks,
                                                barrier_s, barrier_s + stats_s), barrier_event)
    opt_end: dict[tuple[int, int], float] = {}
    opt_start: dict[tuple[int, int], float] = {}
    opt_event: dict[tuple[int, int], int] = {}
    longest_s = 0.0
    for (p, s), t_flush in flush.items():
        pipe = plan.pipelines[p]
        stage = pipe.stages[s]
        dur = cost.optimizer_s(stage, first=s == 0, last=s == pipe.depth - 1)
        start = barrier_s + stats_s
        opt_start[(p, s)], opt_end[(p, s)] = start, start + dur
        opt_event[(p, s)] = rec.add(SimEvent("optimizer", "optimizer", p, s, stage.ranks, start, start + dur),
                                    stats_event[(p, s)])
        longest_s = max(longest_s, dur)
    no_sync_end = max(flush.values()) + stats_s + longest_s  # with free syncs the barrier is the slowest flush

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
