"""A plan's ``grad_reduce: bf16`` sums each gradient bucket in bf16 (``runtime/sync/buckets.py``), within the stated bound.

Three gloo ranks hold the same parameters and fill their gradients with seeded values of very different magnitudes.
The units cover the bucket modes: whole parameters (views of a bucket), a parameter cut along dim 1 over two units
(copied into its buckets and back after the sum), and a replicated-style unit that divides by 2 first (its sum is
of the halves); small buckets, so several all-reduces run. The same units are then reduce-scattered under ZeRO-1
(``zero.ShardedBuckets``, unequal shard weights): every rank's shard within the same bound, each a bf16 sum. After the sync every rank must hold,
per element, the exact sum S of the three ranks' values to within ``(P + 1) u sum_i |g_i|`` (P = 3 terms,
u = 2^-8, bf16's unit roundoff: each input is rounded once and each of the P - 1 additions once, and (P + 1) u
covers their u^2 terms), and values a bf16 sum produced (each exactly a bf16 number). A runtime that ignores
``reduce_dtype`` gives the fp32 sum: the second check fails on it (shown, not skipped: the fp32 run is here too).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ethpipe.runtime.sync.buckets import GradBuckets, _region
from ethpipe.runtime.sync.layout import SyncSlice, SyncUnit
from ethpipe.runtime.sync.zero import ShardedBuckets

from .harness import run_ranks

pytestmark = pytest.mark.dist

UNIT_ROUNDOFF_BF16 = 2.0 ** -8
SHAPES = {"w1": (64, 48), "w2": (48,), "w3": (32, 40), "w4": (16, 24)}
HALVED = "w2"  # its unit divides by 2 before the sum


def _grads(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s gradients: normal values scaled over 12 orders of magnitude, so small terms meet large ones."""
    gen = torch.Generator().manual_seed(1000 + rank)
    out = {}
    for name, shape in SHAPES.items():
        scale = torch.exp(torch.empty(shape).uniform_(-14.0, 14.0, generator=gen))
        out[name] = (torch.randn(shape, generator=gen) * scale).float()
    return out


def _units(world: int) -> list[SyncUnit]:
    holders = tuple(range(world))
    return [SyncUnit(1, holders, (SyncSlice("w1", None, 0, 0), SyncSlice("w3", None, 0, 0))),
            SyncUnit(1, holders, (SyncSlice(HALVED, None, 0, 0),), divide_by=2),
            SyncUnit(0, holders, (SyncSlice("w4", 1, 0, 12),)), SyncUnit(0, holders, (SyncSlice("w4", 1, 12, 12),))]


def _sync(rank: int, world: int, reduce_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    params = {n: nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
    groups = {tuple(range(world)): torch.distributed.group.WORLD}
    buckets = GradBuckets(params, _units(world), groups, bucket_bytes=8 * 1024, reduce_dtype=reduce_dtype)
    assert len(buckets.buckets) > 3  # several all-reduces, each cast and cast back
    assert "copy" in {m for b in buckets.buckets for m in b.modes} and "view" in {m for b in buckets.buckets
                                                                                for m in b.modes}
    for name, g in _grads(rank).items():
        buckets.grads[name].copy_(g)
    buckets.flush()
    buckets.wait()
    return {n: buckets.grads[n].clone() for n in SHAPES}


def _worker(rank: int, world: int, out_dir: str) -> None:
    div = {n: 2.0 if n == HALVED else 1.0 for n in SHAPES}
    exact = {n: sum(_grads(r)[n].double() / div[n] for r in range(world)) for n in SHAPES}
    magnitude = {n: sum(_grads(r)[n].double().abs() / div[n] for r in range(world)) for n in SHAPES}
    bound = (world + 1) * UNIT_ROUNDOFF_BF16
    low, full = _sync(rank, world, torch.bfloat16), _sync(rank, world, None)
    for n in SHAPES:
        assert low[n].dtype == torch.float32  # summed in bf16, kept in the gradients' own dtype
        err = (low[n].double() - exact[n]).abs()
        assert bool((err <= bound * magnitude[n]).all()), f"{n}: worst {float((err / magnitude[n]).max()):.3g} > {bound}"
        assert torch.equal(low[n], low[n].to(torch.bfloat16).float()), f"{n}: not a bf16 sum"
        # fp32: the same sums to fp32's rounding; and not bf16 numbers (the check above tells the two apart)
        assert bool(((full[n].double() - exact[n]).abs() <= 4 * 2.0 ** -24 * magnitude[n]).all())
        assert not torch.equal(full[n], full[n].to(torch.bfloat16).float())
        assert float((low[n].double() - exact[n]).abs().max()) > 0.0  # the bf16 sum did round
    # ZeRO-1: the reduce-scatter sums in bf16, each rank's shard of every bucket within the same bound
    params = {n: nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
    groups = {tuple(range(world)): torch.distributed.group.WORLD}
    sharded = ShardedBuckets(params, _units(world), groups, rank, {0: 3.0, 1: 1.0, 2: 2.0}, 8 * 1024, torch.bfloat16)
    for name, g in _grads(rank).items():
        sharded.grads[name].copy_(g)
    sharded.flush()
    sharded.wait()
    assert sharded.pieces
    for piece in sharded.pieces:
        a, b = piece.span
        want = _region(exact[piece.name], piece.sl).reshape(-1)[a:b]
        scale = _region(magnitude[piece.name], piece.sl).reshape(-1)[a:b]
        got = piece.grad.double()
        assert bool(((got - want).abs() <= bound * scale).all()), piece.name
        assert torch.equal(piece.grad, piece.grad.to(torch.bfloat16).float()), f"{piece.name}: not a bf16 sum"
    Path(out_dir, f"ok-{rank}").write_text("ok")


def test_bf16_gradient_reduction_is_within_its_bound_and_is_a_bf16_sum(tmp_path: Path) -> None:
    run_ranks(3, _worker, (str(tmp_path),), tmp_path, deadline_s=60.0)
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1", "ok-2"]
