"""The one place the runtime does point-to-point: post one batch of ``ethpipe.comm.program`` and wait it.

A batch is one ``dist.batch_isend_irecv`` on the pipeline's group (a grouped NCCL launch: its sends
and receives progress together, so two neighbours exchanging tensors cannot wait on each other), and
it is waited before the next action (the batch before a W: before the next F or B, ``post_deferred``). On NCCL
``wait`` is a stream wait, not a host wait: the host runs
ahead and the next action's kernels queue behind the transfer. Once waited, the executor drops its
references to the sent payloads, so their memory returns to the allocator (ProcessGroupNCCL keeps its
own reference until the transfer is done).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ethpipe.comm.program import P2pOp

Key = tuple[str, int, int]  # (payload, micro-batch, chunk tag): ``comm.program.recv_key`` / ``send_key``


@dataclass
class LivenessProbe:
    """Counts boundary tensors still alive (by storage, so views count too) at every action: a test seam.

    ``samples`` holds, per action started, (action, sent payloads alive, received payloads alive,
    their bytes, stashed stage inputs); received activations become stage inputs, so only received
    gradients count as received payloads.
    """

    sent: list[weakref.ref] = field(default_factory=list)
    received: list[weakref.ref] = field(default_factory=list)
    samples: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    peak_batch_bytes: int = 0  # the most boundary bytes one posted batch held at once (sends + receives)

    def track(self, tensor: torch.Tensor, kind: str) -> None:
        (self.sent if kind == "send" else self.received).append(weakref.ref(tensor.untyped_storage()))

    def sample(self, action: str, stashed: int) -> None:
        sent = [w() for w in self.sent if w() is not None]
        received = [w() for w in self.received if w() is not None]
        num_bytes = sum(s.nbytes() for s in sent + received)  # type: ignore[union-attr]
        self.samples.append((action, len(sent), len(received), num_bytes, stashed))


def post_batch(batch: Sequence[P2pOp], outgoing: Mapping[Key, torch.Tensor], group: dist.ProcessGroup,
               new_buffer: Callable[[P2pOp], torch.Tensor], probe: LivenessProbe | None = None) -> dict[Key, torch.Tensor]:
    """Post every send (from ``outgoing``) and receive (into ``new_buffer(op)``) of ``batch`` as one
    ``batch_isend_irecv``, wait for all of them, and return the received tensors by ``Key``."""
    works, received = post_deferred(batch, outgoing, group, new_buffer, probe)
    for work in works:
        work.wait()
    return received


def post_deferred(batch: Sequence[P2pOp], outgoing: Mapping[Key, torch.Tensor], group: dist.ProcessGroup,
                  new_buffer: Callable[[P2pOp], torch.Tensor], probe: LivenessProbe | None = None
                  ) -> tuple[list[dist.Work], dict[Key, torch.Tensor]]:
    """Post ``batch`` as ``post_batch`` does, without waiting (``comm.program.deferred_batches``: the one before a
    W, the B's sends and, before a run of Ws, the next unit's receives); the caller keeps ``outgoing`` referenced,
    waits each returned work once and reads the returned receive buffers only after that."""
    if not batch:
        return [], {}
    ops: list[dist.P2POp] = []
    received: dict[Key, torch.Tensor] = {}
    for op in batch:
        if op.kind == "send":
            tensor = outgoing[(op.payload, op.microbatch, op.chunk)]
            ops.append(dist.P2POp(dist.isend, tensor, op.peer, group))
        else:
            tensor = received[(op.payload, op.microbatch, op.chunk)] = new_buffer(op)
            ops.append(dist.P2POp(dist.irecv, tensor, op.peer, group))
            if probe is not None and op.payload == "grad":
                probe.track(tensor, "recv")
    if probe is not None:
        unique = {o.tensor.data_ptr(): o.tensor.untyped_storage().nbytes() for o in ops}  # fan-out: one tensor
        probe.peak_batch_bytes = max(probe.peak_batch_bytes, sum(unique.values()))
    return list(dist.batch_isend_irecv(ops)), received
