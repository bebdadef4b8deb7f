"""What each rank communicates in one training step, in order, derived from the schedule and the plan.

**Point-to-point (Megatron's and torch.distributed.pipelining's rule).** The sends an action produces
and the receives the next action needs are posted together as ONE ``batch_isend_irecv`` on the
pipeline's group, and waited before that next action runs (``p2p_batches``). So a 1F1B stage posts
``send a_i + recv g_j`` in one batch where the old executor posted ``send a_i`` and then blocked in
``recv g_j``: under NCCL, whose large sends complete only when the peer's receive runs, the old order
waits in a cycle (each send queued behind a receive the peer posts after its own send). Every send
is waited before the next action, so a rank has at most one send outstanding per peer and direction,
and no payload outlives the action after it. Zero-bubble lists: the batch before a run of ``W``s holds the
B's sends and the receives of the action after the run, and is waited before that action
(``deferred_batches``).

**Peers across TP degrees** (``plan_peers``): activations are replicated over a TP group; receiving
rank k of a stage takes its input from rank ``k % a`` of the previous stage (degree a), and sending
rank j takes its output gradient from rank ``j % b`` of the next (degree b). So every rank receives
each tensor exactly once, and a rank sends to every rank that takes from it.

**Interleaved pipelines** (``Pipeline.num_chunks`` > 1) add the ring's wrap-around: the last stage's chunk c
output is stage 0's chunk c + 1 input (``Peers.wrap_*``, the same TP rule), and each tag names its chunk.

**The whole step** (``step_program``) adds the collectives around the p2p batches, as the runtime
issues them: one TP collective per action on a tp > 1 stage (all TP ranks run the same code, so its
all-reduces keep the TP ranks in step), the block gradient sync's all-reduces (asynchronous, in the
one global bucket order of ``runtime.grad_buckets``), fired by backward hooks during the stage's last
backward and so posted before that backward's sends, waited at the end, and the per-step stats
all-gather over the world. ``ethpipe.comm.replay`` proves such programs
deadlock-free. Before the first step every rank runs one collective on its pipeline group: where
NCCL creates communicators lazily, the first batched p2p would otherwise need every rank of the
group at once, and a TP rank without sends in its warm-up reaches it only after waiting on its peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ethpipe.comm.replay import Item, Op, Post, Wait
from ethpipe.plan import Plan
from ethpipe.schedule import Action, actions_of, last_weight_grad_index

Payload = Literal["act", "grad"]
WORLD = "world"
# The gradient sync's default bucket size (runtime/sync/buckets.py; measured: docs/runtime.md, "Gradient sync").
DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class P2pOp:
    """Send or receive one boundary tensor: micro-batch ``microbatch``'s activation or its gradient."""

    kind: Literal["send", "recv"]
    peer: int  # global rank
    payload: Payload
    microbatch: int
    chunk: int = 0  # the model chunk whose boundary it crosses (interleaved: the receiving side's chunk)

    @property
    def tag(self) -> str:
        return f"{self.payload} {self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Peers:
    """Where one rank's boundary tensors come from and go to (global ranks; None / (): no such neighbour)."""

    act_from: int | None = None  # previous-stage rank whose output is this rank's input
    act_to: tuple[int, ...] = ()  # next-stage ranks that take this rank's output
    grad_from: int | None = None  # next-stage rank that sends this rank the gradient of its output
    grad_to: tuple[int, ...] = ()  # previous-stage ranks that take this rank's input gradient
    # Interleaved only: the ring's wrap-around between the last stage and stage 0 (the other direction)
    wrap_act_from: int | None = None  # stage 0: the last-stage rank whose chunk c output is its chunk c+1 input
    wrap_act_to: tuple[int, ...] = ()  # last stage: stage-0 ranks that take its chunk c output
    wrap_grad_from: int | None = None  # last stage: the stage-0 rank sending its chunk c output's gradient
    wrap_grad_to: tuple[int, ...] = ()  # stage 0: last-stage ranks that take its chunk c+1 input gradient
    num_chunks: int = 1


def plan_peers(plan: Plan, rank: int) -> Peers:
    """This rank's neighbours under the TP fan-in/fan-out rule (module docstring)."""
    pos = plan.position_of(rank)
    pipe = plan.pipelines[pos.pipeline]
    stages = pipe.stages
    i, tp = pos.tp_rank, len(stages[pos.stage].ranks)
    prev = stages[pos.stage - 1].ranks if pos.stage > 0 else ()
    nxt = stages[pos.stage + 1].ranks if pos.stage + 1 < len(stages) else ()
    chunks = pipe.num_chunks
    wrap_prev = stages[-1].ranks if chunks > 1 and pos.stage == 0 else ()
    wrap_next = stages[0].ranks if chunks > 1 and pos.stage == len(stages) - 1 else ()
    return Peers(
        act_from=prev[i % len(prev)] if prev else None,
        act_to=tuple(r for k, r in enumerate(nxt) if k % tp == i),
        grad_from=nxt[i % len(nxt)] if nxt else None,
        grad_to=tuple(r for j, r in enumerate(prev) if j % tp == i),
        wrap_act_from=wrap_prev[i % len(wrap_prev)] if wrap_prev else None,
        wrap_act_to=tuple(r for k, r in enumerate(wrap_next) if k % tp == i),
        wrap_grad_from=wrap_next[i % len(wrap_next)] if wrap_next else None,
        wrap_grad_to=tuple(r for j, r in enumerate(wrap_prev) if j % tp == i),
        num_chunks=chunks,
    )


def _input_side(action: Action, peers: Peers) -> tuple[int | None, int]:
    """Who sends ``action`` its input (F: activation; B: output gradient), and that tensor's chunk tag."""
    c = action.chunk
    if action.kind == "F":
        if peers.act_from is None and c > 0:
            return peers.wrap_act_from, c
        return peers.act_from, c
    if peers.grad_from is None and c < peers.num_chunks - 1:
        return peers.wrap_grad_from, c + 1
    return peers.grad_from, c


def _output_side(action: Action, peers: Peers) -> tuple[tuple[int, ...], int]:
    """Who takes ``action``'s output (F: activation; B: input gradient), and that tensor's chunk tag (the
    activation: the receiving chunk; the gradient: the chunk whose input it is, so both sides agree)."""
    c = action.chunk
    if action.kind == "F":
        if not peers.act_to and c < peers.num_chunks - 1:
            return peers.wrap_act_to, c + 1
        return peers.act_to, c
    if not peers.grad_to and c > 0:
        return peers.wrap_grad_to, c
    return peers.grad_to, c


def recv_key(action: Action, peers: Peers) -> tuple[Payload, int, int]:
    """(payload, micro-batch, chunk tag) of the tensor ``action`` receives: how the executor finds it."""
    return ("act" if action.kind == "F" else "grad"), action.microbatch, _input_side(action, peers)[1]


def send_key(action: Action, peers: Peers) -> tuple[Payload, int, int]:
    """(payload, micro-batch, chunk tag) of the tensor ``action`` sends."""
    return ("act" if action.kind == "F" else "grad"), action.microbatch, _output_side(action, peers)[1]


def action_recvs(action: Action, peers: Peers) -> tuple[P2pOp, ...]:
    """What ``action`` needs before it runs: its input activation (F) or its output's gradient (B); W: none."""
    if action.kind == "W":
        return ()
    src, chunk = _input_side(action, peers)
    payload: Payload = "act" if action.kind == "F" else "grad"
    return () if src is None else (P2pOp("recv", src, payload, action.microbatch, chunk),)


def action_sends(action: Action, peers: Peers) -> tuple[P2pOp, ...]:
    """What ``action`` produces for its neighbours: its output (F) or its input's gradient (B); W: none."""
    if action.kind == "W":
        return ()
    dsts, chunk = _output_side(action, peers)
    payload: Payload = "act" if action.kind == "F" else "grad"
    return tuple(P2pOp("send", d, payload, action.microbatch, chunk) for d in dsts)


def p2p_units(actions: Sequence[Action]) -> tuple[int, ...]:
    """Where each communication unit starts. One action per unit, except in an interleaved list with a
    steady phase (some B before an F), where each F followed by a B is one unit: Megatron-LM's steady state,
    both computed back to back and then one batch with both sends and the next unit's receives. Posting the
    B's receive before its F is what keeps the ring's wrap-around from waiting in a cycle."""
    kinds = "".join(a.kind for a in actions)
    steady = any(a.chunk for a in actions) and "BF" in kinds
    return tuple(k for k in range(len(actions)) if not (steady and kinds[k - 1:k + 1] == "FB"))


def p2p_batches(actions: Sequence[Action], peers: Peers) -> tuple[tuple[P2pOp, ...], ...]:
    """``len(actions) + 1`` batches: batch k is posted and waited right before action k runs; the last one,
    after the last action. Before a unit's first action (``p2p_units``): the previous unit's sends and this
    unit's receives; before its other actions: nothing. Before a run of ``W``s (``deferred_batches``): the
    previous B's sends and the receives of the unit after the run, which are waited there instead."""
    out: list[tuple[P2pOp, ...]] = [()] * (len(actions) + 1)
    starts = p2p_units(actions) + (len(actions),)
    sends: tuple[P2pOp, ...] = ()
    run_start: int | None = None  # the first W of the run of Ws just before this unit
    for lo, hi in zip(starts, starts[1:]):
        unit = actions[lo:hi]
        recvs = tuple(op for a in unit for op in action_recvs(a, peers))
        if actions[lo].kind == "W":
            run_start = lo if run_start is None else run_start
        elif run_start is not None:  # posted with the run's deferred batch: the peer's send need not wait the Ws
            out[run_start] += recvs
            recvs, run_start = (), None
        out[lo] = sends + recvs
        sends = tuple(op for a in unit for op in action_sends(a, peers))
    out[-1] = sends
    return tuple(out)


def deferred_batches(actions: Sequence[Action]) -> frozenset[int]:
    """Batches posted without a wait: the one before a ``W`` (the previous B's sends, and before a run of Ws the
    receives of the unit after it: the W needs nothing from them). Waiting it there would hold the W until the
    peer reaches its matching receive (under NCCL a send completes only with it), which is what zero-bubble
    schedules must not do; it is waited before the next batch that is waited (so a rank still has at most one
    send outstanding per peer and direction). Its receives are posted before the Ws, not after them, so that the
    peer's send for them completes while this rank runs its Ws instead of waiting until they are done (the
    sender's wait, ``cost/rendezvous.py``: the unit after the run is the one that receives)."""
    return frozenset(k for k, a in enumerate(actions) if a.kind == "W")


def pipeline_group(pipeline: int) -> str:
    return f"pipeline {pipeline}"


def tp_group(pipeline: int, stage: int) -> str:
    return f"tp {pipeline}.{stage}"


def sync_group(holders: tuple[int, ...]) -> str:
    return "sync " + ",".join(map(str, holders))


SyncPosts = Sequence[tuple[str, tuple[int, ...]]]  # (label, holder ranks) per all-reduce, in issue order


def communicators(plan: Plan, sync_posts: Callable[[int], SyncPosts]) -> dict[str, tuple[int, ...]]:
    """Every communicator of a plan's step and its members (what ``replay`` needs)."""
    groups: dict[str, tuple[int, ...]] = {WORLD: tuple(range(plan.world_size))}
    for p, pipe in enumerate(plan.pipelines):
        groups[pipeline_group(p)] = pipe.ranks
        for s, stage in enumerate(pipe.stages):
            if stage.tp > 1:
                groups[tp_group(p, s)] = stage.ranks
    for rank in range(plan.world_size):
        for _, holders in sync_posts(rank):
            groups[sync_group(holders)] = holders
    return groups


def step_program(plan: Plan, rank: int, sync_posts: SyncPosts, *, warmup: bool = False, overlap_sync: bool = True,
                 schedule: Callable[[int, int, int], tuple[Action, ...]] | None = None,
                 gather_posts: SyncPosts = ()) -> list[Item]:
    """Rank ``rank``'s communication in one training step, in the order the runtime issues it;
    ``warmup``: the first step, after the start-up collective on each pipeline group (``runtime.groups``);
    ``overlap_sync`` False: the sync's all-reduces only after the step's last sends (``--no-overlap-grad-sync``);
    ``gather_posts``: a sharded optimizer's broadcasts of the updated shards, after the stats (that is,
    after the optimizer step), waited before the next step (here: at the program's end); ``schedule``: the
    action lists (default: each pipeline's own, ``Pipeline.schedule``)."""
    pos = plan.position_of(rank)
    pipe = plan.pipelines[pos.pipeline]
    stage = pipe.stages[pos.stage]
    actions = (schedule(pipe.depth, pos.stage, pipe.num_microbatches) if schedule is not None
               else actions_of(pipe, pos.stage))
    batches = p2p_batches(actions, plan_peers(plan, rank))
    deferred = deferred_batches(actions)
    items: list[Item] = []
    pending: list[int] = []
    p2p_pending: list[int] = []  # deferred p2p batches, waited before the next waited one

    def post(group: str, ops: tuple[Op, ...], wait: bool = True) -> None:
        handle = len(items)
        items.append(Post(handle, group, ops))
        if wait:
            items.append(Wait(handle))
        else:
            pending.append(handle)

    def post_p2p(batch: tuple[P2pOp, ...], defer: bool = False) -> None:
        if not defer:
            items.extend(Wait(h) for h in p2p_pending)
            p2p_pending.clear()
        if batch:
            handle = len(items)
            items.append(Post(handle, pipeline_group(pos.pipeline), tuple(Op(o.kind, o.peer, o.tag) for o in batch)))
            if defer:
                p2p_pending.append(handle)
            else:
                items.append(Wait(handle))

    def post_sync() -> None:
        for label, holders in sync_posts:
            post(sync_group(holders), (Op("collective", tag=label),), wait=False)

    if warmup:
        post(pipeline_group(pos.pipeline), (Op("collective", tag="warm-up"),))
    last_backward = last_weight_grad_index(actions)
    # An interleaved stage's later chunks finish their gradients before its last backward (chunk 0's), so the
    # hooks armed there never see them, and the first buckets in the global order wait for the flush after
    # the step's last sends: its sync does not overlap the last backward (docs/runtime.md, "Schedules").
    overlap_sync = overlap_sync and pipe.num_chunks == 1
    for k, action in enumerate(actions):
        post_p2p(batches[k], defer=k in deferred)
        if stage.tp > 1 and action.kind != "W":  # a weight pass has no TP collective (split_backward)
            post(tp_group(pos.pipeline, pos.stage), (Op("collective", tag=str(action)),))
        if k == last_backward and overlap_sync:  # the hooks fire them during it (its last accumulation), before its sends
            post_sync()
    post_p2p(batches[-1])  # also waits a deferred batch before it
    if not overlap_sync:
        post_sync()
    items.extend(Wait(h) for h in pending)
    post(WORLD, (Op("collective", tag="stats"),))
    gathers = len(items)
    for label, holders in gather_posts:
        post(sync_group(holders), (Op("collective", tag=f"gather {label}"),), wait=False)
    items.extend(Wait(h) for h in pending if h >= gathers)
    return items


def forward_program(plan: Plan, rank: int, actions: Sequence[Action]) -> list[Item]:
    """Rank ``rank``'s communication in a forward-only pass (``runtime/pipeline/validation.py``: one evaluation batch):
    each action's p2p batch, posted and waited before it, its TP collectives, the last sends, then the loss's
    all-reduce over the world."""
    pos = plan.position_of(rank)
    stage = plan.pipelines[pos.pipeline].stages[pos.stage]
    items: list[Item] = []

    def post(group: str, ops: tuple[Op, ...]) -> None:
        if ops:
            items.extend([Post(len(items), group, ops), Wait(len(items))])

    batches = p2p_batches(actions, plan_peers(plan, rank))
    for k, action in enumerate(actions):
        post(pipeline_group(pos.pipeline), tuple(Op(o.kind, o.peer, o.tag) for o in batches[k]))
        if stage.tp > 1:
            post(tp_group(pos.pipeline, pos.stage), (Op("collective", tag=str(action)),))
    post(pipeline_group(pos.pipeline), tuple(Op(o.kind, o.peer, o.tag) for o in batches[-1]))
    post(WORLD, (Op("collective", tag="validation loss"),))
    return items
