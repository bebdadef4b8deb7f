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
from ethpipe.runtime.data import gather_samples, open_tokens, step_sample_ids
from ethpipe.runtime.model import build_full_model


@dataclass(frozen=True)
class ReferenceRun:
    state: dict[str, torch.Tensor]
    losses: list[float]
    grad_norms: list[float]


def reference_train(spec: ModelSpec, data_path: str, global_batch: int, seq_len: int, steps: int, lr: float,
                    weight_decay: float, clip_grad: float, seed: int, shuffle: bool = False,
                    warmup_steps: int = 0, cosine: bool = False, min_lr_ratio: float = 0.1,
                    init_seed: int | None = None) -> ReferenceRun:
    """``seed`` orders the data (shuffle); ``init_seed`` (default: seed) initialises the model."""
    model = build_full_model(spec, seed=seed if init_seed is None else init_seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    data = open_tokens(data_path, spec.vocab_size)
    losses, norms = [], []
    for step in range(steps):
        if step < warmup_steps:
            step_lr = lr * (step + 1) / warmup_steps
        elif cosine:
            progress = min(1.0, (step - warmup_steps) / max(1, steps - 1 - warmup_steps))
            step_lr = lr * min_lr_ratio + 0.5 * (lr - lr * min_lr_ratio) * (1 + math.cos(math.pi * progress))
        else:
            step_lr = lr
        for group in opt.param_groups:
            group["lr"] = step_lr
        ids = step_sample_ids(step, global_batch, data.num_samples(seq_len), shuffle, seed)
        batch = torch.from_numpy(gather_samples(data, ids, seq_len))
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad if clip_grad > 0 else math.inf)
        losses.append(loss.item())
        norms.append(float(norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ReferenceRun({k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms)
