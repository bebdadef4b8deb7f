"""The validation loss (``--val-data``, ``--eval-every``): the same number under any plan, and the reference's.

One forked 3-rank world trains the same model for 4 steps (fp64, evaluation every 2 steps over 2 global batches of
a held-out file) under three plans: two pipelines of depths 2 and 1 with ragged micro-batches, one 3-stage
pipeline with more micro-batches than stages, and a tp-2 stage beside a depth-1 pipeline. Each plan's
validation losses after steps 2 and 4 must equal the single-process reference's mean token loss of the same
held-out samples under the reference's own weights after 2 and 4 steps. Tolerance: fp64, the loss a sum of at most
2 x 8 x 16 token terms in another order: relative 1e-12 is 100x above that order noise (n u ~ 3e-14) and far
below what a broken evaluation makes (a pipeline's share missing, a TP rank counted twice, another batch: 1e-3
or more, as the mutation check below shows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ethpipe.runtime.pipeline.validation as validation
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.data import gather_samples, open_tokens
from ethpipe.runtime.model.decoder import build_full_model
from ethpipe.runtime.train import TrainConfig, train
from ethpipe.tokens.texts import prepare_tokens

from .harness import run_ranks
from .plans import LLAMA_LIKE, make_plan
from .reference import reference_train

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

STEPS, LR, EVERY, BATCHES = 4, 1e-3, 2, 2
TP_PIPES = (Pipeline((Stage((0, 1), "cpu", (0, 6), 2, False),), (3, 1)),
            Pipeline((Stage((2,), "cpu", (0, 6), 1, False),), (2, 2)))
PLANS = {
    "two-pipelines": make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (3, 2, 1)), ([(2, (0, 6))], (2,))]),
    "one-deep": make_plan(LLAMA_LIKE, [([(0, (0, 2)), (1, (2, 4)), (2, (4, 6))], (2, 2, 2, 1, 1))]),
    "tp2-beside-one": Plan("custom", LLAMA_LIKE.name, 8, 16, TP_PIPES, compute_blocks(list(TP_PIPES)),
                           model_spec=LLAMA_LIKE),
}


def _worker(rank: int, world_size: int, data: str, val: str, out_dir: str, broken: bool) -> None:
    if broken:  # a deliberately broken evaluation: the last pipeline's share is dropped
        real = validation.run_stage_forward

        def dropping(module, actions, sizes, inputs, targets, io, device, autocast_dtype):  # type: ignore[no-untyped-def]
            loss = real(module, actions, sizes, inputs, targets, io, device, autocast_dtype)
            return loss * 0 if rank == world_size - 1 else loss

        validation.run_stage_forward = dropping  # type: ignore[assignment]
    for name, plan in PLANS.items():
        if broken and name != "two-pipelines":
            continue
        config = TrainConfig(data=data, steps=STEPS, lr=LR, progress=False, timeout_s=60.0, dtype="fp64",
                             val_data=val, eval_every=EVERY, eval_batches=BATCHES)
        records = train(plan, config, rank, world_size)
        if rank == 0:
            Path(out_dir, f"{name}{'-broken' if broken else ''}.json").write_text(json.dumps(records))


def _reference_val_losses(data: str, val: str, plan_batch: int) -> list[float]:
    """The reference model's mean token loss over the held-out batches after steps 2 and 4."""
    tokens = open_tokens(val, LLAMA_LIKE.vocab_size)
    ids = np.arange(BATCHES * plan_batch)
    batch = torch.from_numpy(gather_samples(tokens, ids, 16))
    out = []
    for steps in (2, 4):
        ref = reference_train(LLAMA_LIKE, data, plan_batch, 16, steps, LR, weight_decay=0.1, clip_grad=0.0, seed=0)
        model = build_full_model(LLAMA_LIKE, dtype=torch.float64)
        model.load_state_dict(ref.state)
        with torch.no_grad():
            logits = model(batch[:, :-1])
            out.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))))
    return out


def test_the_validation_loss_is_the_references_under_every_plan(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    data, val = str(tmp_path / "train.bin"), str(tmp_path / "val.bin")
    words = ["held", "out", "tokens", "train", "loss", "."]
    prepare_tokens([" ".join(rng.choice(words, size=4000))], data)
    prepare_tokens([" ".join(rng.choice(words[::-1], size=1500))], val)
    for broken in (False, True):
        world = tmp_path / f"world-{broken}"
        world.mkdir()
        run_ranks(3, _worker, (data, val, str(tmp_path), broken), world)
    batch = PLANS["two-pipelines"].global_batch_size
    assert all(p.global_batch_size == batch for p in PLANS.values())
    want = _reference_val_losses(data, val, batch)
    for name in PLANS:
        records = json.loads((tmp_path / f"{name}.json").read_text())
        got = [r["val_loss"] for r in records if "val_loss" in r]
        assert [r["step"] for r in records if "val_loss" in r] == [2, 4], name
        np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=name)
        assert all("val_loss" not in r for r in records if r["step"] % EVERY)
    broken = json.loads((tmp_path / "two-pipelines-broken.json").read_text())
    off = [abs(r["val_loss"] / w - 1) for r, w in zip([r for r in broken if "val_loss" in r], want)]
    assert min(off) > 1e-3, off  # the check above would catch it
