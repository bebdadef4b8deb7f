"""The validation loss: held-out tokens through the same pipelines, forward only, every ``--eval-every`` steps.

Each evaluation runs the same ``--eval-batches`` global batches of ``--val-data`` (samples in file order, no
shuffle), split over the pipelines and their micro-batches exactly as a training step splits its batch, with each
stage's forwards only (``pipeline.executor.run_stage_forward``: the same point-to-point batches a step's forwards
post, no autograd graph). The last stages' summed token losses are added over the world in one all-reduce, so
every rank ends with the mean token loss: like the training loss, a function of the weights and the samples
alone, the same for any plan to float tolerance (tests/dist/test_validation.py).

Forward-only action lists: the forwards of the stage's training schedule, in their order (on an interleaved
stage Megatron's groups of ``depth`` micro-batches, chunk by chunk: a plain chunk-major order deadlocks on the
wrap-around from the last stage to the first, as ``tests/unit/test_validation_order.py`` shows by replaying both
under NCCL's rendezvous semantics).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ethpipe.errors import UserError
from ethpipe.plan import Pipeline, Plan
from ethpipe.runtime.data import TokenFile, micro_batches, model_inputs, open_tokens, validate_data, with_documents
from ethpipe.runtime.pipeline.executor import StageIO, run_stage_forward
from ethpipe.schedule import Action, actions_of


def eval_actions(pipe: Pipeline, stage: int) -> tuple[Action, ...]:
    """A stage's forwards of one evaluation batch: its training schedule's forwards, in their order (micro-batches
    in order; interleaved, Megatron's groups of ``depth`` micro-batches chunk by chunk)."""
    return tuple(a for a in actions_of(pipe, stage) if a.kind == "F")


def eval_due(step: int, eval_every: int, num_steps: int) -> bool:
    """Evaluate after step index ``step`` (0-based): every ``eval_every`` steps and after the last."""
    return eval_every > 0 and ((step + 1) % eval_every == 0 or step + 1 == num_steps)


def open_validation(path: str, plan: Plan, num_batches: int, vocab_size: int, documents: bool = False) -> TokenFile:
    """The validation tokens, checked to hold ``num_batches`` global batches of ids the model embeds; sampled by
    document where training is (``--samples documents``)."""
    data = open_tokens(path, vocab_size)
    if documents:
        data = with_documents(data, plan.seq_len)
    need = num_batches * plan.global_batch_size
    if data.num_samples(plan.seq_len) < need:
        raise UserError(f"--val-data '{path}' holds {data.num_samples(plan.seq_len)} samples of {plan.seq_len}+1 "
                        f"tokens but --eval-batches {num_batches} x global_batch_size {plan.global_batch_size} needs "
                        f"{need}: use fewer --eval-batches or more held-out data")
    validate_data(data, plan.seq_len, plan.global_batch_size, num_batches, False, vocab_size)
    return data


def batch_ids(batch: int, global_batch: int) -> np.ndarray:
    """The global sample ids of evaluation batch ``batch``: the file's samples in order."""
    return np.arange(batch * global_batch, (batch + 1) * global_batch, dtype=np.int64)


def mean_token_loss(local_sum: torch.Tensor, num_tokens: int, device: torch.device) -> float:
    """Sum every rank's counted loss over the world (one all-reduce) and divide by the tokens evaluated."""
    total = local_sum.detach().double().reshape(1).to(device)
    dist.all_reduce(total)
    return float(total.item()) / num_tokens


def validation_loss(module: torch.nn.Module, plan: Plan, pipeline: int, stage: int, io: StageIO, data: TokenFile,
                    num_batches: int, device: torch.device, autocast_dtype: torch.dtype | None) -> float:
    """The mean token loss of the first ``num_batches`` global batches of ``data`` under ``plan``'s split (this
    rank's stage ``stage`` of pipeline ``pipeline``); every rank of the world calls it at the same step."""
    pipe = plan.pipelines[pipeline]
    actions = eval_actions(pipe, stage)
    total = torch.zeros((), dtype=io.param_dtype, device=device)
    counted = 0
    for batch in range(num_batches):
        ids = batch_ids(batch, plan.global_batch_size)
        counted += data.counted_tokens(ids, plan.seq_len)
        rows = micro_batches(plan, data, ids, pipeline, device) if io.first or io.last else []
        inputs = [model_inputs(r) for r in rows] if io.first else None
        targets = [r[:, 1:].contiguous() for r in rows] if io.last else None
        total = total + run_stage_forward(module, actions, pipe.micro_batch_sizes, inputs, targets, io, device,
                                          autocast_dtype)
    return mean_token_loss(total, counted, device)

