"""TEST-ONLY fault injection, switched on by environment variables (never set them in production).

They pinpoint a fault at a moment a test cannot hit from outside (docs/reliability.md):

- ``ETHPIPE_TEST_KILL=RANK:POINT@STEP`` SIGKILLs rank RANK at POINT of step STEP, where POINT is
  ``forward`` (its second forward of the step: mid-1F1B, peers blocked on it), ``allreduce``
  (right after it issued its block all-reduces, before they complete) or ``save`` (after it wrote
  its checkpoint shard, before the coordinator wrote the metadata and the commit). Under torchrun
  it fires in the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so the restart recovers.
- ``ETHPIPE_TEST_ENOSPC_AT_SAVE=STEP`` makes every rank's checkpoint write of step STEP fail with
  ``OSError(ENOSPC)`` (disk full, where a size-limited tmpfs cannot be mounted).
- ``ETHPIPE_TEST_OVERFLOW=RANK@STEP`` writes inf into one gradient element of rank RANK after the
  block all-reduces of step STEP (an fp16 overflow, for the loss scaler).
- ``ETHPIPE_TEST_HANG=RANK@STEP`` (RANK ``*`` = every rank) makes the rank sleep forever at the
  start of step STEP, outside any collective: only the watchdog can end it.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ethpipe.errors import UserError

KILL_ENV = "ETHPIPE_TEST_KILL"
ENOSPC_ENV = "ETHPIPE_TEST_ENOSPC_AT_SAVE"
HANG_ENV = "ETHPIPE_TEST_HANG"
OVERFLOW_ENV = "ETHPIPE_TEST_OVERFLOW"
KILL_POINTS = ("forward", "allreduce", "save")


@dataclass(frozen=True)
class KillSpec:
    rank: int
    point: str
    step: int


def kill_spec() -> KillSpec | None:
    """The parsed ``ETHPIPE_TEST_KILL`` (None when unset, or in a torchrun restart)."""
    text = os.environ.get(KILL_ENV)
    if not text or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    head, _, step = text.partition("@")
    rank, _, point = head.partition(":")
    if point not in KILL_POINTS:
        raise UserError(f"{KILL_ENV}={text!r} must look like RANK:POINT@STEP with POINT one of {KILL_POINTS}")
    return KillSpec(int(rank), point, int(step))


def maybe_kill(spec: KillSpec | None, rank: int, point: str, step: int) -> None:
    if spec is not None and (spec.rank, spec.point, spec.step) == (rank, point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_enospc(step: int) -> None:
    if os.environ.get(ENOSPC_ENV) == str(step):
        raise OSError(errno.ENOSPC, f"No space left on device ({ENOSPC_ENV}={step}, injected)")


def maybe_hang(rank: int, step: int) -> None:
    text = os.environ.get(HANG_ENV)
    if not text:
        return
    who, _, at = text.partition("@")
    if int(at) == step and who in ("*", str(rank)):
        while True:
            time.sleep(3600)


def maybe_overflow(grads: Callable[[], Sequence[torch.Tensor]], rank: int, step: int) -> None:
    """``grads()``: the gradients this rank counts in the non-finite check (a sharded optimizer's: its shards),
    asked for only when the hook is armed (it runs every step)."""
    text = os.environ.get(OVERFLOW_ENV)
    if not text:
        return
    who, _, at = text.partition("@")
    if int(at) == step and who == str(rank):
        grads()[0].view(-1)[0] = float("inf")


class ForwardKill:
    """Counts this rank's forwards in the armed step; SIGKILLs itself at the second one (or the only one)."""

    def __init__(self, spec: KillSpec) -> None:
        self._spec = spec
        self._step = -1
        self._target = 0
        self._seen = 0

    @staticmethod
    def arm(module: nn.Module, spec: KillSpec | None, rank: int) -> ForwardKill | None:
        if spec is None or spec.point != "forward" or spec.rank != rank:
            return None
        hook = ForwardKill(spec)
        module.register_forward_hook(lambda *_: hook._on_forward())
        return hook

    def begin_step(self, step: int, num_microbatches: int) -> None:
        self._step, self._target, self._seen = step, min(2, num_microbatches), 0

    def _on_forward(self) -> None:
        self._seen += 1
        if self._step == self._spec.step and self._seen == self._target:
            os.kill(os.getpid(), signal.SIGKILL)
