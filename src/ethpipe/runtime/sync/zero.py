"""ZeRO-1 across pipelines that cut the model differently: each sync unit's holders shard its AdamW state.

The holders of a gradient bucket (one rank per pipeline, per TP slice: ``sync_layout``) are exactly the
ranks that keep identical copies of its parameters, so they can share its optimizer state. Every bucket
tensor (the flat buffer, each direct slice: ``grad_buckets``) is cut into one contiguous shard per holder,
in proportion to the plan's ``shard_weights`` (equal by default); the cut is pure arithmetic on numbers
every holder has, so all holders agree on it. Per step:

1. instead of an all-reduce, one ``reduce`` per shard sums the gradient onto that shard's owner (the same
   bytes a reduce-scatter moves, also for unequal shards, on gloo and NCCL alike);
2. each rank runs AdamW (``torch.optim.adamw.adamw``, the functional form of the unsharded optimizer) on
   its shards only, cut at parameter boundaries so weight decay stays per parameter, on views of the
   parameters themselves (the parameters of a bucket live in a flat buffer laid out like its gradients);
3. each owner broadcasts its updated shard to the other holders (the all-gather), in the one global
   bucket order reversed (a reversed total order is one order too), waited before the next step's forwards.

The update is elementwise and the reduce sums the same gradient the all-reduce did, so training is
exactly the unsharded one. Memory per parameter: fp32 weights and gradients (8 bytes) plus 8 / k bytes
of moments over k holders, against 16. The global norm counts each element once from the owned shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ethpipe.runtime.sync.buckets import GradBuckets, _Bucket, _numel, _region
from ethpipe.runtime.sync.layout import SyncSlice, SyncUnit

Segment = tuple[int, int, SyncSlice]  # [lo, hi) of a bucket tensor that holds one parameter slice


@dataclass(frozen=True)
class Piece:
    """This rank's part of its shard of one bucket tensor that lies in one parameter slice."""

    sl: SyncSlice
    span: tuple[int, int]  # [start, end) in ``_region(param, sl).reshape(-1)``: where the piece sits in the slice
    grad: torch.Tensor  # 1-D view of the summed gradient
    param: torch.Tensor  # 1-D view of the parameter's values, the same elements
    decay: bool  # AdamW weight decay applies (matrices and embeddings, as ``config.make_optimizer``)
    where: tuple[int, int, int]  # (index in ``ShardedBuckets.tensors``, start, end): the same elements there

    @property
    def name(self) -> str:
        return self.sl.name


def shard_bounds(numel: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """[start, end) of each holder's shard of ``numel`` elements, in proportion to ``weights``."""
    total, acc, cuts = sum(weights), 0.0, [0]
    for w in weights:
        acc += w
        cuts.append(round(numel * acc / total))
    cuts[-1] = numel
    return list(zip(cuts[:-1], cuts[1:]))


class ShardedBuckets(GradBuckets):
    """``GradBuckets`` whose holders each own a shard of every bucket (module docstring)."""

    def __init__(self, params: Mapping[str, nn.Parameter], units: Sequence[SyncUnit],
                 groups: Mapping[tuple[int, ...], dist.ProcessGroup], rank: int, weights: Mapping[int, float],
                 bucket_bytes: int) -> None:
        self.rank, self.weights = rank, weights
        super().__init__(params, units, groups, bucket_bytes)
        # Bucket tensors in order, each with its parameter twin and the parameter segments it holds.
        self.tensors: list[tuple[_Bucket, torch.Tensor, torch.Tensor, list[Segment]]] = []
        self._param_flats: dict[int, torch.Tensor] = {}  # each bucket's flat parameter buffer, by id(bucket)
        for bucket in self.buckets:
            self._layout_params(bucket)
        self.pieces: list[Piece] = [p for k in range(len(self.tensors)) for p in self._pieces(k)]
        self._gathers: list[dist.Work] = []
        self._check_cover()

    def _layout_params(self, bucket: _Bucket) -> None:
        """Give the bucket's parameters the layout of its gradients: a flat parameter buffer for its viewed and
        copied slices (viewed parameters then live in it), the parameter's own rows for direct slices."""
        flat_params = torch.empty_like(bucket.flat)
        segments = []
        for sl, mode, offset in zip(bucket.slices, bucket.modes, bucket.offsets):
            if mode == "direct":
                continue
            param = self.params[sl.name]
            n = _numel(param, sl)
            region = flat_params[offset:offset + n]
            with torch.no_grad():
                region.copy_(_region(param.data, sl).reshape(-1))
            if mode == "view":
                param.data = region.view(param.shape)
            segments.append((offset, offset + n, sl))
        self._param_flats[id(bucket)] = flat_params  # read back by wait_params (copied slices)
        if bucket.flat.numel():
            self.tensors.append((bucket, bucket.flat, flat_params, segments))
        for sl, mode in zip(bucket.slices, bucket.modes):
            if mode == "direct":
                grad = _region(self.grads[sl.name], sl).view(-1)
                param = _region(self.params[sl.name].data, sl).view(-1)
                self.tensors.append((bucket, grad, param, [(0, grad.numel(), sl)]))

    def _bounds(self, bucket: _Bucket, numel: int) -> list[tuple[int, int]]:
        return shard_bounds(numel, [self.weights.get(h, 1.0) for h in bucket.holders])

    def _shards(self, bucket: _Bucket, numel: int) -> list[tuple[int, int, int]]:
        """(owner, start, end) of each non-empty shard (an empty one is skipped alike on every holder)."""
        return [(h, a, b) for h, (a, b) in zip(bucket.holders, self._bounds(bucket, numel)) if b > a]

    def _pieces(self, k: int) -> list[Piece]:
        bucket, grad, param, segments = self.tensors[k]
        start, end = self._bounds(bucket, grad.numel())[bucket.holders.index(self.rank)]
        return [Piece(sl, (a - lo, b - lo), grad[a:b], param[a:b], self.params[sl.name].dim() >= 2,
                      (k, a, b))
                for lo, hi, sl in segments for a, b in [(max(lo, start), min(hi, end))] if a < b]

    def _check_cover(self) -> None:
        """Internal invariant: the bucket tensors' segments cover every element of every parameter exactly once
        (``sync_layout`` partitions each parameter into slices), so the shards do too."""
        covered = {name: 0 for name in self.params}
        for _, _, _, segments in self.tensors:
            for lo, hi, sl in segments:
                covered[sl.name] += hi - lo
        wrong = [n for n, p in self.params.items() if covered[n] != p.numel()]
        assert not wrong, f"sync layout does not cover {wrong[:3]} exactly once"

    def _num_collectives(self, bucket: _Bucket) -> int:
        return sum(len(self._shards(bucket, t.numel())) for b, t, *_ in self.tensors if b is bucket)

    def _reduce(self, bucket: _Bucket, tensors: list[torch.Tensor]) -> list[dist.Work]:
        group = self.groups[bucket.holders]
        works = []
        for t in tensors:
            flat = t.reshape(-1)  # a contiguous buffer or region: a view
            for holder, a, b in self._shards(bucket, flat.numel()):
                works.append(dist.reduce(flat[a:b], dst=holder, op=dist.ReduceOp.SUM, group=group, async_op=True))
        return works

    def copied_bytes(self) -> int:
        """Beyond ``GradBuckets.copied_bytes`` (the copied gradients), the weight mirror of those slices: a
        copied slice's parameter keeps its own storage beside its place in the flat parameter buffer."""
        return 2 * super().copied_bytes()

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's shards of the summed gradients: every element of the world's counts once."""
        return [p.grad for p in self.pieces]

    def gather_params(self) -> None:
        """After this rank's optimizer step: each owner broadcasts its updated shard to the other holders, in the
        one global bucket order reversed (the first layers' first; ``wait_params`` before the next forwards)."""
        for bucket, _, param, _ in reversed(self.tensors):
            if len(bucket.holders) < 2:
                continue
            group = self.groups[bucket.holders]
            for holder, a, b in self._shards(bucket, param.numel()):
                self._gathers.append(dist.broadcast(param[a:b], src=holder, group=group, async_op=True))

    def gather_posts(self) -> list[tuple[str, tuple[int, ...]]]:
        """(label, holders) of each broadcast ``gather_params`` issues, in order (``comm.program.step_program``)."""
        return [(b.label, b.holders) for b, t, *_ in reversed(self.tensors) if len(b.holders) > 1
                for _ in self._shards(b, t.numel())]

    def wait_params(self) -> None:
        for work in self._gathers:
            work.wait()
        self._gathers.clear()
        with torch.no_grad():  # copied slices: their parameter columns from the flat buffer
            for bucket in self.buckets:
                for sl, mode, offset in zip(bucket.slices, bucket.modes, bucket.offsets):
                    if mode == "copy":
                        region = _region(self.params[sl.name].data, sl)
                        region.copy_(self._param_flats[id(bucket)][offset:offset + region.numel()].view(region.shape))

    def gather_full(self, values: Mapping[int, torch.Tensor], out: Mapping[str, torch.Tensor]) -> None:
        """Fill ``out`` (full local tensors, e.g. on the CPU, by parameter name) from every holder's pieces:
        ``values[i]`` is this rank's value of its i-th piece (e.g. an AdamW moment). Collective over every
        bucket's holders, in the global bucket order, one bucket tensor's worth of device memory at a time."""
        by_tensor: dict[int, list[int]] = {}
        for i, piece in enumerate(self.pieces):
            by_tensor.setdefault(piece.where[0], []).append(i)
        for k, (bucket, grad, _, segments) in enumerate(self.tensors):
            buf = torch.zeros_like(grad)
            for i in by_tensor.get(k, []):
                _, a, b = self.pieces[i].where
                buf[a:b].copy_(values[i])
            if len(bucket.holders) > 1:
                group = self.groups[bucket.holders]
                for holder, a, b in self._shards(bucket, buf.numel()):
                    dist.broadcast(buf[a:b], src=holder, group=group)
            for lo, hi, sl in segments:
                region = _region(out[sl.name], sl)
                region.copy_(buf[lo:hi].view(region.shape))
