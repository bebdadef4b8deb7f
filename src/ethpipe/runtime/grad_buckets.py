"""DDP-style block gradient sync: persistent flat buffers per bucket, all-reduces fired from backward hooks.

A stage's sync units (``sync_layout``: each block's slices, then the tied matrix's) are cut into buckets
of at most ``bucket_bytes`` in backward order (a unit's slices reversed: the last layers' gradients are
final first), and every bucket owns one flat buffer for the whole run. A parameter that lies whole in
one bucket has its ``.grad`` as a view of that buffer: autograd accumulates into it in place, the
all-reduce sums it in place, and nothing is copied or concatenated. A parameter split across units
(a shard that several TP degrees cut differently) is copied into its buckets and back.

During the stage's last backward (``arm``), each parameter's post-accumulate-grad hook marks it final;
a bucket fires its all-reduce once all its parameters are final AND every bucket before it in the one
global order has fired. The order is the same on every rank: blocks in descending order (the order
their gradients become final), each block's units as ``sync_layout`` lists them, the tied matrix last;
so each group sees its all-reduces in the same order on all of its members and overlapping groups
cannot deadlock (``ethpipe.comm.replay``). ``flush`` fires what no hook reached (a parameter without a
gradient), ``wait`` waits for all of them. Buckets with one holder skip the collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ethpipe.runtime.sync_layout import SyncSlice, SyncUnit
from ethpipe.units import runs_of_bytes

# Default bucket size: see docs/runtime.md, "Gradient sync" (measured).
DEFAULT_BUCKET_BYTES = 25 * 2**20


def sync_order(units: Sequence[SyncUnit]) -> list[SyncUnit]:
    """The one global issue order: blocks descending (stable within a block), tied units last."""
    indexed = list(enumerate(units))
    indexed.sort(key=lambda iu: (iu[1].tag == "tied", -iu[1].block, iu[0]))
    return [u for _, u in indexed]


@dataclass
class _Bucket:
    label: str
    holders: tuple[int, ...]
    divide_by: int
    slices: list[SyncSlice]
    flat: torch.Tensor
    offsets: list[int]
    copied: list[bool]  # per slice: copied in and out (else a view the parameter's .grad is)
    pending: set[str] = field(default_factory=set)
    work: dist.Work | None = None
    issued: bool = False


def _numel(param: nn.Parameter, sl: SyncSlice) -> int:
    return param.numel() if sl.dim is None else param.numel() // param.shape[sl.dim] * sl.length


def _region(param: nn.Parameter, sl: SyncSlice) -> torch.Tensor:
    grad = param.grad
    assert grad is not None
    return grad if sl.dim is None else grad.narrow(sl.dim, sl.start, sl.length)


class GradBuckets:
    """This stage's sync buckets (module docstring); ``groups`` maps holder tuples to process groups."""

    def __init__(self, params: Mapping[str, nn.Parameter], units: Sequence[SyncUnit],
                 groups: Mapping[tuple[int, ...], dist.ProcessGroup], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 on_issue: Callable[[str], None] | None = None) -> None:
        self.params, self.groups, self.on_issue = params, groups, on_issue
        self._names = {id(p): n for n, p in params.items()}
        uses: dict[str, int] = {}
        for unit in units:
            for sl in unit.slices:
                uses[sl.name] = uses.get(sl.name, 0) + 1
        self.buckets: list[_Bucket] = []
        self._owner: dict[str, list[_Bucket]] = {}
        for unit in sync_order(units):
            for run in runs_of_bytes(list(reversed(unit.slices)),
                                     lambda sl: _numel(params[sl.name], sl) * params[sl.name].element_size(),
                                     bucket_bytes):
                self._add(unit, run, uses)
        for bucket in self.buckets:
            for sl in bucket.slices:
                self._owner.setdefault(sl.name, []).append(bucket)
        self.viewed = {sl.name for b in self.buckets for sl, c in zip(b.slices, b.copied) if not c}
        self.started_s = 0.0
        self._armed = False
        self._next = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._final) for n, p in params.items() if n in self._owner]

    def _add(self, unit: SyncUnit, run: list[SyncSlice], uses: Mapping[str, int]) -> None:
        first = self.params[run[0].name]
        sizes = [_numel(self.params[sl.name], sl) for sl in run]
        flat = torch.zeros(sum(sizes), dtype=first.dtype, device=first.device)
        offsets, copied, offset = [], [], 0
        for sl, n in zip(run, sizes):
            param = self.params[sl.name]
            whole = sl.dim is None or sl.length == param.shape[sl.dim]
            view = whole and uses[sl.name] == 1
            if view:  # from now on the parameter's gradient lives in the bucket
                param.grad = flat[offset:offset + n].view(param.shape)
            offsets.append(offset)
            copied.append(not view)
            offset += n
        self.buckets.append(_Bucket(unit.label, unit.holders, unit.divide_by, list(run), flat, offsets, copied))

    def zero_grads(self) -> None:
        """The next step's gradients start at zero: bucket views are zeroed in place, others dropped."""
        for bucket in self.buckets:
            bucket.flat.zero_()
            bucket.work, bucket.issued = None, False
        for name, param in self.params.items():
            if name not in self.viewed:
                param.grad = None
        self._armed, self._next = False, 0

    def arm(self) -> None:
        """The stage's last backward starts: each gradient is final after its next accumulation."""
        for bucket in self.buckets:
            bucket.pending = {sl.name for sl in bucket.slices}
        self._armed = True
        self.started_s = time.time()

    def _final(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        name = self._names[id(param)]
        for bucket in self._owner.get(name, []):
            bucket.pending.discard(name)
        self._issue_ready()

    def _issue_ready(self, everything: bool = False) -> None:
        while self._next < len(self.buckets) and (everything or not self.buckets[self._next].pending):
            self._issue(self.buckets[self._next])
            self._next += 1

    def flush(self) -> None:
        """After the last backward: fire every bucket not fired yet, in order."""
        self._issue_ready(everything=True)
        self._armed = False

    def _issue(self, bucket: _Bucket) -> None:
        for sl, offset, copied in zip(bucket.slices, bucket.offsets, bucket.copied):
            if copied:
                param = self.params[sl.name]
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                region = _region(param, sl)
                bucket.flat[offset:offset + region.numel()].view(region.shape).copy_(region)
        if bucket.divide_by != 1:
            bucket.flat.div_(bucket.divide_by)
        if len(bucket.holders) > 1:
            bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self.groups[bucket.holders],
                                          async_op=True)
        bucket.issued = True
        if self.on_issue is not None:
            self.on_issue(bucket.label)

    def wait(self, on_done: Callable[[str], None] | None = None) -> None:
        """Wait in issue order and copy split parameters back; ``on_done(label)`` after each (tracing)."""
        assert all(b.issued for b in self.buckets), "wait() before flush()"
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            for sl, offset, copied in zip(bucket.slices, bucket.offsets, bucket.copied):
                if copied:
                    region = _region(self.params[sl.name], sl)
                    region.copy_(bucket.flat[offset:offset + region.numel()].view(region.shape))
            if on_done is not None:
                on_done(bucket.label)

    def posts(self) -> list[tuple[str, tuple[int, ...]]]:
        """(label, holders) of each all-reduce in issue order (``ethpipe.comm.program.step_program``)."""
        return [(b.label, b.holders) for b in self.buckets if len(b.holders) > 1]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
