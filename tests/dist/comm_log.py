"""Record every torch.distributed call a rank makes (a test double around the real functions).

The runtime calls ``dist.<fn>`` through the module, so replacing the module's attributes inside a rank
records exactly what it issues: batched p2p (kind, peer, elements, dtype) and every collective (group,
elements of its input, dtype). ``isend``/``irecv`` are left alone: ``P2POp`` checks its op against them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Call:
    fn: str  # "batch", or the torch.distributed function: "all_reduce", "all_gather_single", "send", ...
    group: tuple[int, ...]
    ops: tuple[tuple[str, int, int, str], ...] = ()  # batch: (kind, peer, elements, dtype) per op
    numel: int = 0
    dtype: str = ""
    default_group: bool = False  # issued on the default (world) group itself, not a group of the same ranks

    @property
    def num_bytes(self) -> int:
        size = torch.empty((), dtype=getattr(torch, self.dtype.removeprefix("torch."))).element_size() if self.dtype else 0
        return self.numel * size


@dataclass
class CommLog:
    calls: list[Call] = field(default_factory=list)

    def steps(self) -> list[list[Call]]:
        """The calls split after start-up (its last call: the barrier before the first step) and after each
        step's stats all-gather over the world (one per step, ``gather_stats``)."""
        out: list[list[Call]] = [[]]
        for call in self.calls:
            out[-1].append(call)
            if (call.fn == STATS and call.default_group) or call.fn == START_BARRIER:
                out.append([])
        return out[:-1] if not out[-1] else out


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


STATS = "all_gather_single"  # the step's stats collective (``observe/metrics.gather_stats``)
START_BARRIER = "monitored_barrier"  # start-up's last collective (``start/preflight.wait_for_every_rank``)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "reduce_scatter_single", "reduce", "broadcast",
               "gather", "gather_object", "all_gather_object", "barrier", "monitored_barrier", "send", "recv")
TWO_TENSORS = ("all_gather", "all_gather_single", "reduce_scatter_single")  # (output, input, ...): count the input


@contextmanager
def recording(log: CommLog) -> Iterator[CommLog]:
    originals = {name: getattr(dist, name) for name in ("batch_isend_irecv", *COLLECTIVES)}

    def batch(ops: list[dist.P2POp]) -> Any:
        kinds = tuple(("send" if op.op.__name__ == "isend" else "recv", op.peer, op.tensor.numel(),
                       str(op.tensor.dtype)) for op in ops)
        log.calls.append(Call("batch", _ranks(ops[0].group), kinds))
        return originals["batch_isend_irecv"](ops)

    def collective(name: str):  # type: ignore[no-untyped-def]
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            first = args[1] if name in TWO_TENSORS else (args[0] if args else None)
            first = first[0] if isinstance(first, list) and first else first
            numel, dtype = (first.numel(), str(first.dtype)) if isinstance(first, torch.Tensor) else (0, "")
            log.calls.append(Call(name, _ranks(group), numel=numel, dtype=dtype, default_group=group is None))
            return originals[name](*args, **kwargs)
        return call

    try:
        dist.batch_isend_irecv = batch  # type: ignore[assignment]
        for name in COLLECTIVES:
            setattr(dist, name, collective(name))
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor reads that move data to the host on a GPU (``.item()``, ``.tolist()``, ``.cpu()``,
    ``.numpy()``, ``float(t)``, ``int(t)``, ``bool(t)``), wherever they happen in the rank's own thread.

    Left out: torch.optim's reads of AdamW's ``step`` counters, host (CPU) scalars on every device for the
    single-tensor and foreach implementations (CUDA's fused AdamW, what the runtime uses there, reads none).
    """

    READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
                       torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in self.READS and not sys._getframe(1).f_globals.get("__name__", "").startswith("torch.optim"):
            self.count += 1
        return func(*args, **(kwargs or {}))
