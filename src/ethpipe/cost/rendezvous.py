"""The runtime's point-to-point as a graph of waits: one rule for the simulator and the planner's replay.

``comm/program.py``: the sends of one communication unit (an action; in an interleaved steady state an F and
the B after it) and the receives the next unit needs are ONE batch, posted right after the unit and waited
before the next unit runs. Under NCCL a send completes only when its peer's receive runs, so a transfer is a
rendezvous: it starts once the sender has posted the send and the receiver has posted the batch holding its
receive (after the receiver's previous unit, or before its run of Ws: below), and both sides wait for it, the receiver before its unit, the
sender before its own next unit (the same batch) and, for its last sends, before its flush. The batch before a
``W`` holds the B's sends and, before a run of Ws, the receives of the unit after the run; it is waited before
the next batch is posted (``comm.program.deferred_batches``): the Ws run at once, and those receives were
posted before them, so a peer's send to them completes while this stage runs its Ws.

A transfer that takes no time (free communication: the tests' tables) is taken as buffered: its sender does
not wait for it, and the receiver waits for its data only at the action that consumes it (as every timeline
did before the rendezvous was priced). Every real link costs more than nothing (``CostModel.p2p_s``).

So a stage's list becomes nodes, each ending when its stage may go on: one per action (a unit's first action
also waits its batch: the unit's receives and the previous unit's sends), a wait node where a deferred batch is
waited (its sends, and the receives it posted before the Ws), and a last node, the flush (the last sends).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ethpipe.comm.program import deferred_batches, p2p_units
from ethpipe.schedule import Action, input_source, output_dest


class Recv(NamedTuple):
    """A receive waited at a node: for the stage's action ``action``, whose producer on stage ``src`` posts the
    send right after its node ``node`` (its action's, or its unit's last: ``comm.program.p2p_batches``)."""

    action: int
    src: int
    node: int


class Send(NamedTuple):
    """A send waited at a node: action ``action``'s output, posted right after this stage's node ``posted``,
    received by stage ``dst``, which posts that receive right after its node ``post`` (-1: at the start)."""

    action: int
    posted: int
    dst: int
    post: int


class Node(NamedTuple):
    """One step of a stage: an action (-1: a wait node, or the flush) after the waits of its batch."""

    action: int
    recvs: tuple[Recv, ...]
    sends: tuple[Send, ...]
    src: tuple[int, int] | None  # (stage, node) that produces the action's own input (None: it receives none)
    posted: int  # the node after which the batch holding ``recvs`` was posted (-1: at the start): the one before
    # this node, or for a wait node the one before its run of Ws


def stage_nodes(lists: Sequence[tuple[Action, ...]], num_chunks: int = 1) -> tuple[tuple[Node, ...], ...]:
    """Each stage's nodes (module docstring); the last one of each stage is its flush."""
    depth = len(lists)
    where = [{(a.kind, a.microbatch, a.chunk): k for k, a in enumerate(acts)} for acts in lists]
    layout = [_layout(acts) for acts in lists]
    node_of = [[n for n, (k, *_) in enumerate(nodes) if k >= 0] for nodes in layout]
    post_of = [[0] * len(acts) for acts in lists]  # per stage and action: the node after which its receive is posted
    sent_after: list[dict[int, int]] = [{} for _ in lists]  # per stage and action: the node after which it sends
    for s, nodes in enumerate(layout):
        for _, recvs, sends, posted in nodes:
            for k in recvs:
                post_of[s][k] = posted
            sent_after[s].update(sends)
    producer: list[list[tuple[int, int] | None]] = []  # per stage and action: (stage, action) of its input
    consumer: list[list[tuple[int, int] | None]] = []  # (stage, node after which it posts that receive)
    for s, acts in enumerate(lists):
        ins: list[tuple[int, int] | None] = []
        outs: list[tuple[int, int] | None] = []
        ends: dict[tuple[str, int], tuple[int, int, int, int]] = {}  # (kind, chunk) -> its source and destination
        for a in acts:
            end = ends.get((a.kind, a.chunk))
            if end is None:
                end = ends[(a.kind, a.chunk)] = (input_source(a.kind, s, a.chunk, depth, num_chunks)
                                                  + output_dest(a.kind, s, a.chunk, depth, num_chunks))
            up, uc, dst, dc = end
            ins.append((up, where[up][(a.kind, a.microbatch, uc)]) if up >= 0 else None)
            outs.append((dst, post_of[dst][where[dst][(a.kind, a.microbatch, dc)]]) if dst >= 0 else None)
        producer.append(ins)
        consumer.append(outs)
    out = []
    for s, nodes in enumerate(layout):
        ins, outs, built = producer[s], consumer[s], []
        for k, recvs, sends, posted in nodes:
            # A timed transfer starts once its producer has posted the send: after the producer's action, or after
            # the last action of its unit (an interleaved F's send goes out with its unit's B's). A free one is
            # buffered: it is there once the producer's action ends (``src``).
            got = tuple(Recv(r, i[0], sent_after[i[0]][i[1]]) for r in recvs if (i := ins[r]) is not None
                        ) if recvs else ()
            waited = tuple(Send(i, at, *o) for i, at in sends if (o := outs[i]) is not None) if sends else ()
            own = ins[k] if k >= 0 else None
            built.append(Node(k, got, waited, (own[0], node_of[own[0]][own[1]]) if own is not None else None, posted))
        out.append(tuple(built))
    return tuple(out)


def _layout(actions: tuple[Action, ...]) -> list[tuple[int, tuple[int, ...], tuple[tuple[int, int], ...], int]]:
    """Per node: (action or -1, the actions whose receives its batch holds, (sending action, node after which
    the send was posted) of the sends it waits, the node after which its receives were posted)."""
    starts = p2p_units(actions) + (len(actions),)
    deferred = deferred_batches(actions)
    nodes: list[tuple[int, tuple[int, ...], tuple[tuple[int, int], ...], int]] = []
    pending: tuple[int, ...] = ()  # the previous unit's actions: their sends go out in the next batch
    posted: tuple[tuple[int, int], ...] = ()  # sends posted by a deferred batch, not waited yet
    run_posted: int | None = None  # where the current run of Ws' deferred batch was posted (the next receives too)
    for lo, hi in zip(starts, starts[1:]):
        unit = tuple(range(lo, hi))
        if lo in deferred:  # a W's batch: the pending sends go out, waited before the next batch
            run_posted = len(nodes) - 1 if run_posted is None else run_posted
            posted += tuple((k, len(nodes) - 1) for k in pending)
            pending = ()
            nodes.append((lo, unit, (), len(nodes) - 1))
            nodes.extend((k, (), (), len(nodes) - 1) for k in unit[1:])
            continue
        if run_posted is not None:  # the deferred batch is waited here, with this unit's receives posted in it
            nodes.append((-1, unit, posted, run_posted))
            nodes.append((lo, (), (), len(nodes) - 1))
            posted, run_posted = (), None
        else:
            nodes.append((lo, unit, tuple((k, len(nodes) - 1) for k in pending), len(nodes) - 1))
        nodes.extend((k, (), (), len(nodes) - 1) for k in unit[1:])
        pending = unit
    assert not (posted and pending), "a deferred batch leaves no unit pending, and a unit after it waits the posted"
    nodes.append((-1, (), posted + tuple((k, len(nodes) - 1) for k in pending), len(nodes) - 1))
    return nodes
