"""Executes one stage's action list (``ethpipe.schedule``) for one training step.

Communication is ``ethpipe.comm.program.p2p_batches`` of the actions, posted by ``runtime.p2p``:
before each action, one ``batch_isend_irecv`` carries the previous action's sends and this action's
receives, and is waited (NCCL-safe: docs/runtime.md, "On GPUs"); the batch before a W holds the B's sends
and, before a run of Ws, the next unit's receives, and is waited before the next F or B instead
(``comm.program.deferred_batches``); an interleaved
steady-state F and the B after it share one batch before the F and one after the B (``p2p_units``). Liveness is bounded: a sent payload
is dropped as soon as its batch is waited, and a forward's output is not kept for the backward (its
autograd edge is: ``torch.autograd.graph.get_gradient_edge``), so besides the stashed stage inputs a
stage holds at most one outgoing and one incoming boundary tensor (two of each inside an interleaved
F-B unit; the edge would keep the output alive only if the stage's last op saved its own result; a
decoder stage ends in a residual add, or in the boundary cast). Where the list splits a micro-batch's backward (a ``W`` for it: zero-bubble
schedules), its ``B`` computes and sends the input gradient only and keeps the weight work
(``runtime.split_backward``) until its ``W``. Micro-batches may have different
sizes, so every buffer is shaped from the plan's micro-batch size, and any count (also fewer than
stages) works. The last stage's loss is the SUM of token losses times ``loss_scale``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ethpipe.comm.program import P2pOp, Peers, deferred_batches, p2p_batches, p2p_units, recv_key, send_key
from ethpipe.runtime.adapt.emulate import Emulator
from ethpipe.runtime.pipeline.p2p import Key, LivenessProbe, post_batch, post_deferred
from ethpipe.runtime.pipeline.split_backward import WeightWork, backward_input, backward_weight
from ethpipe.runtime.observe.timeline import Timeline
from ethpipe.schedule import Action, last_weight_grad_index, split_microbatches


@dataclass(frozen=True)
class StageIO:
    """This stage's place in its pipeline and where its boundary tensors go (``comm.program.plan_peers``).

    Activations and their gradients cross stage boundaries in ``act_dtype``: the autocast dtype under
    bf16/fp16 (half the bytes on the links between stages), else the parameters' dtype. Inside a stage the
    residual stream runs in the dtype the stage sets (``Decoder._stream``: the compute dtype under autocast,
    fp32 with ``--fp32-residual``) and the loss in ``param_dtype`` (fp32, or fp64 in the exactness mode).
    """

    group: dist.ProcessGroup
    peers: Peers
    first: bool
    last: bool
    hidden_size: int
    seq_len: int
    act_dtype: torch.dtype = torch.float32
    param_dtype: torch.dtype = torch.float32
    count_loss: bool = True  # False on all but the first rank of a TP group: the loss is replicated there


@dataclass
class _Step:
    """One step's state on one stage; each action runs in a method, so no local outlives it."""

    module: nn.Module
    io: StageIO
    sizes: tuple[int, ...]
    inputs: list[torch.Tensor] | None
    targets: list[torch.Tensor] | None
    loss_scale: float
    timed: Callable[[Action, Callable[[], Any], str], Any]
    device: torch.device
    probe: LivenessProbe | None
    split: frozenset[int] = frozenset()  # micro-batches whose B is input-only (a W follows)
    params: list[torch.Tensor] = field(default_factory=list)  # what a split B leaves to its W (trainable ones)
    # (micro-batch, chunk) -> (stage input that needs a gradient, or None on the first stage's chunk 0; what
    # backward starts from)
    stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | GradientEdge]] = field(default_factory=dict)
    weight_work: dict[int, WeightWork] = field(default_factory=dict)  # split micro-batches between B and W
    loss_total: torch.Tensor | None = None

    def new_buffer(self, op: P2pOp) -> torch.Tensor:
        return torch.empty(self.sizes[op.microbatch], self.io.seq_len, self.io.hidden_size,
                           dtype=self.io.act_dtype, device=self.device)

    def first(self, action: Action) -> bool:
        """Does ``action`` run the model's start (embedding) / end (head and loss)? Interleaved: the first stage's
        chunk 0 / the last stage's last chunk."""
        return self.io.first and action.chunk == 0

    def last(self, action: Action) -> bool:
        return self.io.last and action.chunk == self.io.peers.num_chunks - 1

    def forward(self, action: Action, received: dict[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
        mb, io, chunk = action.microbatch, self.io, action.chunk
        first, last = self.first(action), self.last(action)
        x = None if first else received.pop(recv_key(action, io.peers)).requires_grad_()

        def run() -> torch.Tensor:
            inp = self.inputs[mb] if first else x  # the stage sets its residual stream's dtype (Decoder._stream)
            out = self.module(inp) if io.peers.num_chunks == 1 else self.module(inp, chunk)
            if last:
                logits, labels = out.to(io.param_dtype), self.targets[mb]  # type: ignore[index]
                with torch.autocast(device_type=self.device.type, enabled=False):  # the loss in param_dtype
                    return self.module.loss_sum(logits, labels) * self.loss_scale  # type: ignore[operator]
            return out.to(io.act_dtype)

        out = self.timed(action, run, "F")
        assert out is not None
        keep = torch.is_grad_enabled()  # a forward-only pass (``run_stage_forward``) keeps nothing for a backward
        if last:
            if io.count_loss:
                self.loss_total = out.detach() if self.loss_total is None else self.loss_total + out.detach()
            if keep:
                self.stash[(mb, chunk)] = (x, out)
            return {}
        if keep:
            self.stash[(mb, chunk)] = (x, get_gradient_edge(out))  # the output's memory goes once it is sent
        payload = out.detach()
        if self.probe is not None:
            self.probe.track(payload, "send")
        return {send_key(action, io.peers): payload}

    def backward(self, action: Action, received: dict[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
        mb, io = action.microbatch, self.io
        x, start = self.stash.pop((mb, action.chunk))
        grad = None if self.last(action) else received.pop(recv_key(action, io.peers))
        if mb in self.split:
            assert x is not None, "the first stage has no input gradient to split off"
            payload, self.weight_work[mb] = self.timed(action, lambda: backward_input(start, grad, x, self.params),
                                                        "B-input")
        else:
            self.timed(action, lambda: torch.autograd.backward(start, grad), "B")  # type: ignore[arg-type]
            if self.first(action):
                return {}
            assert x is not None and x.grad is not None
            payload = x.grad
        if self.probe is not None:
            self.probe.track(payload, "send")
        return {send_key(action, io.peers): payload}

    def weight(self, action: Action, received: dict[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
        work = self.weight_work.pop(action.microbatch)
        self.timed(action, lambda: backward_weight(work), "W")
        return {}


@contextlib.contextmanager
def _precision(module: nn.Module, device: torch.device, autocast_dtype: torch.dtype | None) -> Iterator[None]:
    """One autocast region and one weight-cast step around a whole step (or forward-only pass): ONE 16-bit copy of
    each weight serves every micro-batch in flight (``weight_cast.py``: its gradients go straight into the fp32
    ``.grad``). Nothing under fp32 / fp64."""
    autocast = (torch.autocast(device_type=device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    weight_cast = getattr(module, "weight_cast", None)
    casting = weight_cast.step(autocast_dtype) if weight_cast is not None else contextlib.nullcontext()
    with autocast, casting:
        yield


def run_stage_step(
    module: nn.Module,
    actions: tuple[Action, ...],
    micro_batch_sizes: tuple[int, ...],
    inputs: list[torch.Tensor] | None,
    targets: list[torch.Tensor] | None,
    io: StageIO,
    loss_scale: float,
    emulator: Emulator | None,
    step: int,
    timeline: Timeline,
    autocast_dtype: torch.dtype | None = None,
    on_last_backward: Callable[[], None] | None = None,
    probe: LivenessProbe | None = None,
    before_last_backward: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Run all actions; returns this stage's (scaled) loss sum as a 0-d tensor (0 off the last stage).

    ``before_last_backward`` runs just before the action after which the stage's gradients are final (its
    last whole B, or its last W: ``schedule.last_weight_grad_index``; the gradient sync arms its hooks),
    ``on_last_backward`` once the step's last sends are posted (the sync fires what is left).
    """
    device = next(module.parameters()).device
    assert (inputs is not None) == io.first and (targets is not None) == io.last
    assert emulator is None or timeline.synchronous, "pacing needs host-synchronous marks"
    last_backward = last_weight_grad_index(actions)  # the stage's gradients are final after it

    def timed(action: Action, fn: Callable[[], Any], kind: str) -> Any:
        start, start_cpu = timeline.mark(), time.thread_time()
        out = fn()
        end = timeline.mark()
        if emulator is not None:
            # On CPU the real compute is this thread's CPU time: time spent descheduled while other
            # ranks share the core is not work, and pacing on the wall clock absorbs it.
            elapsed = float(end) - float(start)  # type: ignore[arg-type]
            compute = time.thread_time() - start_cpu if device.type == "cpu" else elapsed
            emulator.pace(kind, micro_batch_sizes[action.microbatch], compute, elapsed, step, action.chunk)
            end = timeline.mark()
        timeline.span(str(action), start, end)
        return out

    split = split_microbatches(actions)
    state = _Step(module, io, micro_batch_sizes, inputs, targets, loss_scale, timed, device, probe, split,
                  [p for p in module.parameters() if p.requires_grad] if split else [])
    run_action = {"F": state.forward, "B": state.backward, "W": state.weight}
    batches = p2p_batches(actions, io.peers)
    deferred = deferred_batches(actions)
    outgoing: dict[Key, torch.Tensor] = {}
    # A deferred batch: its works, its sent payloads, its receive buffers (the next unit's: read once waited)
    in_flight: tuple[list[dist.Work], dict[Key, torch.Tensor], dict[Key, torch.Tensor]] = ([], {}, {})

    def wait_deferred() -> dict[Key, torch.Tensor]:
        for work in in_flight[0]:
            work.wait()
        early = dict(in_flight[2])
        for part in in_flight:  # a work is waited once (gloo's send work waits for a second send otherwise)
            part.clear()
        return early

    starts = frozenset(p2p_units(actions))  # where a batch is posted (inside an interleaved F-B unit: none)
    received: dict[Key, torch.Tensor] = {}
    with _precision(module, device, autocast_dtype):
        for k, action in enumerate(actions):
            if k in starts:
                assert not received, f"unused receives {sorted(received)}"
                if k in deferred:  # before a W: the B's sends (and the next unit's receives) go out, not waited
                    works, early = post_deferred(batches[k], outgoing, io.group, state.new_buffer, probe)
                    in_flight[0].extend(works)
                    in_flight[1].update(outgoing)
                    in_flight[2].update(early)
                else:
                    received = wait_deferred()
                    received.update(post_batch(batches[k], outgoing, io.group, state.new_buffer, probe))
                outgoing = {}  # waited (or held in in_flight): the step no longer references the sent payloads
            if probe is not None:
                probe.sample(str(action), len(state.stash) + len(state.weight_work))
            if k == last_backward and before_last_backward is not None:
                before_last_backward()
            outgoing.update(run_action[action.kind](action, received))
            if k == last_backward:
                timeline.end_phase()
        assert not received, f"unused receives {sorted(received)}"
        left = wait_deferred()
        assert not left, "a run of Ws at the end has no unit after it to receive for"
        post_batch(batches[-1], outgoing, io.group, state.new_buffer, probe)
    timeline.sends_done()
    del outgoing
    if on_last_backward is not None:
        on_last_backward()
    assert not state.stash and not state.weight_work, "every forwarded micro-batch must be backwarded"
    if state.loss_total is None:
        return torch.zeros((), dtype=io.param_dtype, device=device)
    return state.loss_total


def run_stage_forward(module: nn.Module, actions: tuple[Action, ...], micro_batch_sizes: tuple[int, ...],
                      inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None, io: StageIO,
                      device: torch.device, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Forward-only actions (``runtime/pipeline/validation.eval_actions``) without autograd: the point-to-point batches a
    step's forwards post, nothing kept past its action. Returns this stage's summed token loss (0 off the last
    stage, and off all but the first rank of a TP group)."""
    state = _Step(module, io, micro_batch_sizes, inputs, targets, 1.0, lambda action, fn, kind: fn(), device, None)
    batches = p2p_batches(actions, io.peers)
    outgoing: dict[Key, torch.Tensor] = {}
    with torch.no_grad(), _precision(module, device, autocast_dtype):
        for k, action in enumerate(actions):
            assert action.kind == "F", "a forward-only pass runs forwards only"
            received = post_batch(batches[k], outgoing, io.group, state.new_buffer)
            outgoing = state.forward(action, received)
            assert not received and not state.stash, f"unused receives {sorted(received)}"
        post_batch(batches[-1], outgoing, io.group, state.new_buffer)
    return state.loss_total if state.loss_total is not None else torch.zeros((), dtype=io.param_dtype, device=device)

