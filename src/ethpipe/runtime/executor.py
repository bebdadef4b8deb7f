"""Executes one stage's 1F1B action list (``ethpipe.schedule``) for one training step.

Communication is implied by the actions: ``F`` on a non-first stage receives its input
(blocking recv), a non-last stage sends its output on (isend, waited at the end of the step);
``B`` mirrors that with gradients. Micro-batches may have different sizes, so every buffer is
shaped from the plan's micro-batch size, and any count (also fewer than stages) works.
The last stage's loss is the SUM of token losses times ``loss_scale`` (1 / global batch tokens).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ethpipe.runtime.emulate import Emulator
from ethpipe.schedule import Action

@dataclass(frozen=True)
class StageIO:
    """Where this stage's inputs come from and outputs go (global ranks in its pipeline group).

    Activations cross stage boundaries in ``act_dtype``: the parameters' dtype (fp32 also under
    bf16 autocast, fp64 in the exactness mode), and the loss is summed in it too.
    """

    group: dist.ProcessGroup
    prev_rank: int | None
    next_rank: int | None
    hidden_size: int
    seq_len: int
    act_dtype: torch.dtype = torch.float32
    next_ranks: tuple[int, ...] | None = None  # where outputs go (None: (next_rank,)); under tp, several or none
    prev_ranks: tuple[int, ...] | None = None  # where input gradients go (None: (prev_rank,))
    count_loss: bool = True  # False on all but the first rank of a TP group: the loss is replicated there

    @property
    def output_ranks(self) -> tuple[int, ...]:
        return self.next_ranks if self.next_ranks is not None else tuple(r for r in (self.next_rank,) if r is not None)

    @property
    def input_grad_ranks(self) -> tuple[int, ...]:
        return self.prev_ranks if self.prev_ranks is not None else tuple(r for r in (self.prev_rank,) if r is not None)


@dataclass
class Timeline:
    """Per-step timing of one rank and optional trace events (name, start_s, end_s)."""

    busy_s: float = 0.0
    phase_s: float = 0.0  # start of step to end of last backward
    record: bool = False
    events: list[tuple[str, float, float]] = field(default_factory=list)

    def add(self, name: str, start_s: float, end_s: float) -> None:
        if self.record:
            self.events.append((name, start_s, end_s))


def _sync_device(device: torch.device) -> None:
    """Make timings honest on asynchronous accelerators (no-op on CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


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
) -> torch.Tensor:
    """Run all actions; returns this stage's (scaled) loss sum as a 0-d tensor (0 off the last stage)."""
    device = next(module.parameters()).device
    first, last = io.prev_rank is None, io.next_rank is None
    assert (inputs is not None) == first and (targets is not None) == last
    stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    loss_total = torch.zeros((), dtype=io.act_dtype, device=device)
    step_start = time.time()
    num_backward = sum(1 for a in actions if a.kind == "B")
    done_backward = 0

    def autocast() -> contextlib.AbstractContextManager[None]:
        if autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=autocast_dtype)

    def timed(action: Action, size: int, fn: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        _sync_device(device)
        start, start_cpu = time.time(), time.thread_time()
        out = fn()
        _sync_device(device)
        if emulator is not None:
            # On CPU the real compute is this thread's CPU time: time spent descheduled while other
            # ranks share the core is not work, and pacing on the wall clock absorbs it.
            elapsed = time.time() - start
            compute = time.thread_time() - start_cpu if device.type == "cpu" else elapsed
            emulator.pace(action.kind, size, compute, elapsed, step)
        end = time.time()
        timeline.busy_s += end - start
        timeline.add(str(action), start, end)
        return out

    # One autocast region for the whole step: its cache keeps ONE 16-bit copy of each weight for all
    # micro-batches in flight (a region per forward would keep one copy per in-flight micro-batch).
    with autocast():
        for action in actions:
            mb = action.microbatch
            size = micro_batch_sizes[mb]
            if action.kind == "F":
                if first:
                    x: torch.Tensor | None = None
                    inp = inputs[mb]  # type: ignore[index]
                else:
                    buf = torch.empty(size, io.seq_len, io.hidden_size, dtype=io.act_dtype, device=device)
                    dist.recv(buf, src=io.prev_rank, group=io.group)
                    x = inp = buf.requires_grad_()

                def forward() -> torch.Tensor:
                    out = module(inp)
                    if last:
                        logits, labels = out.to(io.act_dtype), targets[mb]  # type: ignore[index]
                        with torch.autocast(device_type=device.type, enabled=False):  # the loss in act_dtype
                            return module.loss_sum(logits, labels) * loss_scale  # type: ignore[operator]
                    return out.to(io.act_dtype)

                out = timed(action, size, forward)
                assert out is not None
                if last:
                    if io.count_loss:
                        loss_total += out.detach()
                else:
                    payload = out.detach()
                    sends.extend((dist.isend(payload, dst=dst, group=io.group), payload) for dst in io.output_ranks)
                stash[mb] = (x, out)
            else:
                x, out = stash.pop(mb)
                if last:
                    timed(action, size, lambda: out.backward())  # type: ignore[func-returns-value]
                else:
                    grad = torch.empty_like(out)
                    dist.recv(grad, src=io.next_rank, group=io.group)
                    timed(action, size, lambda: torch.autograd.backward(out, grad))  # type: ignore[func-returns-value]
                if not first:
                    assert x is not None and x.grad is not None
                    payload = x.grad
                    sends.extend((dist.isend(payload, dst=dst, group=io.group), payload) for dst in io.input_grad_ranks)
                done_backward += 1
                if done_backward == num_backward:
                    timeline.phase_s = time.time() - step_start
                    if on_last_backward is not None:
                        on_last_backward()
    for work, _payload in sends:
        work.wait()
    assert not stash, "every forwarded micro-batch must be backwarded"
    return loss_total
