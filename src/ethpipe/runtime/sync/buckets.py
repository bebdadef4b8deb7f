"""DDP-style block gradient sync: persistent gradient buffers, all-reduces fired from backward hooks.

A stage's sync units (``sync_layout``: each block's slices, then the tied matrix's) are cut into buckets
of at most ``bucket_bytes`` in backward order (a unit's slices reversed: the last layers' gradients are
final first). Every gradient lives in persistent memory for the whole run, in one of three ways:

- **view**: a parameter that lies whole in one bucket has its ``.grad`` as a view of the bucket's flat
  buffer: autograd accumulates into it in place, the all-reduce sums it in place, nothing is copied.
- **direct**: a piece along dim 0 of a parameter that several TP degrees cut differently (``SyncSlice.split``)
  is a contiguous region of its gradient (a tensor of its own on every holder), all-reduced in place as
  its own tensor: no copy, the same tensors on every holder.
- **copy**: a piece along dim 1 (a row-parallel weight's columns) is not contiguous where a holder's shard
  spans several pieces; there it is copied into the bucket's flat buffer and back (+1x gradient memory
  for those slices only, ``copied_bytes``); a holder whose shard is exactly the piece views it.

During the stage's last backward (``arm``), each parameter's post-accumulate-grad hook marks it final;
a bucket fires its all-reduces once all its parameters are final AND every bucket before it in the one
global order has fired. The order is the same on every rank: blocks descending (the order their
gradients become final; ``cost/sync.block_sync_order``), each block's units as ``sync_layout`` lists
them, the tied matrix last; so each group sees its all-reduces in the same order on all of its members
and overlapping groups cannot deadlock (``ethpipe.comm.replay``). ``flush`` fires what no hook reached
(a parameter without a gradient), ``wait`` waits for all of them. Buckets with one holder skip the
collective.

``reduce_dtype`` (a plan's ``grad_reduce: bf16``, off by default): each bucket tensor is cast to that dtype, summed
in it and cast back when waited (``zero.ShardedBuckets``: reduce-scattered in it, the shard cast back): half the
bytes on the wire for fp32 gradients, at the cost of the reduction's rounding (docs/runtime.md, "16-bit gradient
reduction": each element ends within ``(P + 1) u`` times the sum of its P holders' absolute values, u = 2^-8 for
bf16, for P up to 256; void beyond). The low-precision copies live from
the issue to the wait: at most 2 bytes per synced parameter, which the memory model counts
(``memory.reduce_copy_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ethpipe.comm.program import DEFAULT_BUCKET_BYTES
from ethpipe.runtime.sync.layout import SyncSlice, SyncUnit
from ethpipe.units import runs_of_bytes

Mode = Literal["view", "direct", "copy"]


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
    modes: list[Mode]
    offsets: list[int]  # into ``flat`` (view and copy slices)
    flat: torch.Tensor
    pending: set[str] = field(default_factory=set)
    works: list[dist.Work] = field(default_factory=list)
    issued: bool = False


def _numel(param: nn.Parameter, sl: SyncSlice) -> int:
    return param.numel() if sl.dim is None else param.numel() // param.shape[sl.dim] * sl.length


def _region(grad: torch.Tensor, sl: SyncSlice) -> torch.Tensor:
    return grad if sl.dim is None else grad.narrow(sl.dim, sl.start, sl.length)


class GradBuckets:
    """This stage's sync buckets (module docstring); ``groups`` maps holder tuples to process groups."""

    def __init__(self, params: Mapping[str, nn.Parameter], units: Sequence[SyncUnit],
                 groups: Mapping[tuple[int, ...], dist.ProcessGroup],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype | None = None) -> None:
        self.params, self.groups = params, groups
        self.reduce_dtype = reduce_dtype
        self._low: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # by id(bucket): (low copy, tensor)
        self._names = {id(p): n for n, p in params.items()}
        uses: dict[str, int] = {}
        for unit in units:
            for sl in unit.slices:
                uses[sl.name] = uses.get(sl.name, 0) + 1
        self.grads: dict[str, torch.Tensor] = {}  # every synced parameter's persistent gradient
        self._own: set[str] = set()  # split parameters: their gradient is a tensor of its own
        self.buckets: list[_Bucket] = []
        for unit in sync_order(units):
            for run in runs_of_bytes(list(reversed(unit.slices)),
                                     lambda sl: _numel(params[sl.name], sl) * params[sl.name].element_size(),
                                     bucket_bytes):
                self._add(unit, run, uses)
        self._owner: dict[str, list[_Bucket]] = {}
        for bucket in self.buckets:
            for sl in bucket.slices:
                self._owner.setdefault(sl.name, []).append(bucket)
        self._armed = False
        self._next = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._final) for n, p in params.items() if n in self._owner]
        self.zero_grads()

    def _add(self, unit: SyncUnit, run: list[SyncSlice], uses: Mapping[str, int]) -> None:
        modes: list[Mode] = []
        for sl in run:  # from global facts only (``split``, the dim), so every holder issues the same tensors
            param = self.params[sl.name]
            whole = sl.dim is None or sl.length == param.shape[sl.dim]
            if sl.split and sl.dim == 0:
                modes.append("direct")
            else:
                modes.append("view" if whole and uses[sl.name] == 1 else "copy")
        sizes = [_numel(self.params[sl.name], sl) if m != "direct" else 0 for sl, m in zip(run, modes)]
        first = self.params[run[0].name]
        flat = torch.zeros(sum(sizes), dtype=first.dtype, device=first.device)
        offsets, offset = [], 0
        for sl, mode, n in zip(run, modes, sizes):
            param = self.params[sl.name]
            if mode == "view":  # from now on the parameter's gradient lives in the bucket
                self.grads[sl.name] = flat[offset:offset + n].view(param.shape)
            elif sl.name not in self.grads:
                self.grads[sl.name] = torch.zeros_like(param)
                self._own.add(sl.name)
            offsets.append(offset)
            offset += n
        self.buckets.append(_Bucket(unit.label, unit.holders, unit.divide_by, list(run), modes, offsets, flat))

    def zero_grads(self) -> None:
        """The next step's gradients start at zero, in their persistent memory (re-bound each step, so nothing
        that replaced a ``.grad`` can leave the sync summing a buffer autograd no longer writes)."""
        self._low.clear()  # a step that ended before its wait leaves its low-precision copies here
        for bucket in self.buckets:
            bucket.flat.zero_()
            bucket.works, bucket.issued = [], False
        for name in self._own:
            self.grads[name].zero_()  # a split parameter's own gradient (views were zeroed with their bucket)
        for name, param in self.params.items():
            param.grad = self.grads.get(name)
        self._armed, self._next = False, 0

    def arm(self) -> None:
        """The stage's last backward starts: each gradient is final after its next accumulation."""
        for bucket in self.buckets:
            bucket.pending = {sl.name for sl in bucket.slices}
        self._armed = True

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

    def _tensors(self, bucket: _Bucket) -> list[torch.Tensor]:
        """What the bucket's all-reduces sum, in order: its flat buffer (if any), then each direct slice."""
        direct = [_region(self.grads[sl.name], sl) for sl, m in zip(bucket.slices, bucket.modes) if m == "direct"]
        return ([bucket.flat] if bucket.flat.numel() else []) + direct

    def _issue(self, bucket: _Bucket) -> None:
        for sl, mode, offset in zip(bucket.slices, bucket.modes, bucket.offsets):
            if mode == "copy":
                region = _region(self.grads[sl.name], sl)
                bucket.flat[offset:offset + region.numel()].view(region.shape).copy_(region)
        tensors = self._tensors(bucket)
        if bucket.divide_by != 1:
            for t in tensors:
                t.div_(bucket.divide_by)
        if len(bucket.holders) > 1:
            bucket.works = self._reduce(bucket, tensors)
        bucket.issued = True

    def _reduce(self, bucket: _Bucket, tensors: list[torch.Tensor]) -> list[dist.Work]:
        """Sum the bucket's tensors over its holders: one all-reduce each (``zero.ShardedBuckets``: one
        reduce-scatter each)."""
        group = self.groups[bucket.holders]
        if self.reduce_dtype is not None:
            pairs = [(t.to(self.reduce_dtype), t) for t in tensors]
            self._low[id(bucket)] = pairs
            tensors = [low for low, _ in pairs]
        return [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True) for t in tensors]

    def _finish(self, bucket: _Bucket) -> None:
        """After the bucket's collectives are waited, before copied slices are copied back (sharded: the summed
        shard into place): sums made in ``reduce_dtype`` back into the gradients."""
        for low, t in self._low.pop(id(bucket), []):
            t.copy_(low)

    def wait(self, on_done: Callable[[str], None] | None = None) -> None:
        """Wait in issue order and copy split parameters back; ``on_done(label)`` after each (tracing)."""
        assert all(b.issued for b in self.buckets), "wait() before flush()"
        for bucket in self.buckets:
            for work in bucket.works:
                work.wait()
            self._finish(bucket)
            for sl, mode, offset in zip(bucket.slices, bucket.modes, bucket.offsets):
                if mode == "copy":
                    region = _region(self.grads[sl.name], sl)
                    region.copy_(bucket.flat[offset:offset + region.numel()].view(region.shape))
            if on_done is not None:
                on_done(bucket.label)

    def posts(self) -> list[tuple[str, tuple[int, ...]]]:
        """(label, holders) of each collective in issue order (``ethpipe.comm.program.step_program``)."""
        return [(b.label, b.holders) for b in self.buckets if len(b.holders) > 1
                for _ in range(self._num_collectives(b))]

    def _num_collectives(self, bucket: _Bucket) -> int:
        return len(self._tensors(bucket))

    def copied_bytes(self) -> int:
        """The extra gradient memory of copied slices (their flat-buffer space): what the memory model leaves out."""
        return sum(_numel(self.params[sl.name], sl) * self.params[sl.name].element_size()
                   for b in self.buckets for sl, m in zip(b.slices, b.modes) if m == "copy")

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()

