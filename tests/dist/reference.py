"""Plain single-process PyTorch training: the ground truth every plan must reproduce.

Deliberately written without the runtime's helpers (only the model and the data order are
shared): torch.optim.AdamW, mean cross-entropy over the whole global batch, clip_grad_norm_.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.data import gather_samples, open_tokens, step_sample_ids, with_documents
from ethpipe.runtime.model.decoder import build_full_model


@dataclass(frozen=True)
class ReferenceRun:
    state: dict[str, torch.Tensor]
    losses: list[float]
    grad_norms: list[float]


def reference_train(spec: ModelSpec, data_path: str, global_batch: int, seq_len: int, steps: int, lr: float,
                    weight_decay: float, clip_grad: float, seed: int, shuffle: bool = False,
                    warmup_steps: int = 0, cosine: bool = False, min_lr_ratio: float = 0.1,
                    init_seed: int | None = None, dtype: torch.dtype = torch.float64,
                    per_sample: bool = False, autocast: torch.dtype | None = None,
                    skip_steps: frozenset[int] = frozenset(), betas: tuple[float, float] = (0.9, 0.95),
                    eps: float = 1e-8, wsd_decay_fraction: float | None = None,
                    documents: bool = False) -> ReferenceRun:
    """``seed`` orders the data (shuffle); ``init_seed`` (default: seed) initialises the model.

    ``dtype`` float64 by default: the comparisons in tests/dist/exactness.py are made there.
    ``per_sample`` accumulates the batch one sample at a time (another summation order, same
    maths): the reference's own order-noise floor. ``autocast``: bf16/fp16 autocast over the
    model (fp32 weights). ``skip_steps``: steps whose optimizer update is skipped (as an fp16
    overflow does), data and learning rate advancing as usual. ``wsd_decay_fraction``: warmup-stable-decay, the
    lr constant until the last ``fraction`` of the steps after warm-up, then linear down to ``lr * min_lr_ratio``.
    ``documents``: samples by document (``--samples documents``): padded targets ignored, the loss the mean over
    the batch's counted targets.
    """
    model = build_full_model(spec, seed=seed if init_seed is None else init_seed, dtype=dtype)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=eps)
    data = open_tokens(data_path, spec.vocab_size)
    if documents:
        data = with_documents(data, seq_len)
    losses, norms = [], []
    for step in range(steps):
        if step < warmup_steps:
            step_lr = lr * (step + 1) / warmup_steps
        elif wsd_decay_fraction is not None:
            decaying = max(1, round((steps - warmup_steps) * wsd_decay_fraction))
            first_decaying = steps - decaying
            step_lr = lr if step < first_decaying else (
                lr - (lr - lr * min_lr_ratio) * min(1.0, (step - first_decaying + 1) / decaying))
        elif cosine:
            progress = min(1.0, (step - warmup_steps) / max(1, steps - 1 - warmup_steps))
            step_lr = lr * min_lr_ratio + 0.5 * (lr - lr * min_lr_ratio) * (1 + math.cos(math.pi * progress))
        else:
            step_lr = lr
        for group in opt.param_groups:
            group["lr"] = step_lr
        ids = step_sample_ids(step, global_batch, data.num_samples(seq_len), shuffle, seed)
        batch = torch.from_numpy(gather_samples(data, ids, seq_len))
        counted = int((batch[:, 1:] >= 0).sum())  # every target, or (documents) the unpadded ones
        chunks = batch.split(1) if per_sample else (batch,)
        loss = torch.zeros((), dtype=dtype)
        for chunk in chunks:
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                logits = model(chunk[:, :-1].clamp_min(0)).to(dtype)
            part = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                   reduction="sum", ignore_index=-100) / counted
            part.backward()
            loss += part.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad if clip_grad > 0 else math.inf)
        losses.append(loss.item())
        norms.append(float(norm))
        if step not in skip_steps:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return ReferenceRun({k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms)
