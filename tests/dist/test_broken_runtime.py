"""The exactness checks are sharp: each deliberately broken runtime fails them, the real one passes.

One forked 3-rank world (two pipelines: depth 2 and depth 1, so blocks are really all-reduced)
trains the same 3 steps four times: with the real runtime and with three bugs patched into it
inside the ranks. Each run is compared with the float64 reference by the same checks every
exactness test uses (``exactness.py``):

- weight decay on norm gains and biases (the optimizer grouping is wrong): parameters;
- loss scaled by 1 / samples instead of 1 / tokens: loss and gradient norm (AdamW is nearly
  scale invariant, so the parameters alone would barely see it);
- one block's all-reduce skipped: gradient norm and parameters;
- a stage cut inside a layer (``ethpipe.sublayers``) whose lone half skips its residual add, on a plan in half
  layers whose correct run passes: loss and parameters.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ethpipe.runtime.sync.stage_optim as stage_optim
import ethpipe.runtime.step as step_module
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.model.decoder import DecoderLayer
from ethpipe.runtime.sync.buckets import GradBuckets
from ethpipe.runtime.config import ADAM_BETAS, ADAM_EPS
from ethpipe.runtime.train import TrainConfig, train

from .exactness import fails, assert_params_match, assert_stats_match
from .harness import run_ranks
from .plans import LLAMA_LIKE, half_layer_plan, make_plan
from .reference import reference_train

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

STEPS, LR = 3, 1e-3
PLAN = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2, 1)), ([(2, (0, 6))], (2, 1))])
# The same samples and ranks, the first pipeline cut between layer 3's attention (rank 0) and its MLP (rank 1).
HALF_PLAN = half_layer_plan(LLAMA_LIKE, [([(0, (0, 7), False), (1, (7, 12), False)], (2, 1), "1f1b"),
                                         ([(2, (0, 12), False)], (2, 1), "1f1b")])


def _decay_everything(module: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(module.parameters(), lr=config.lr, betas=ADAM_BETAS,
                             eps=ADAM_EPS, weight_decay=config.weight_decay)


def _per_sample_loss(real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        args = list(args)
        args[6] = args[6] * PLAN.seq_len  # loss_scale: 1 / (batch * seq_len) -> 1 / batch
        return real(*args, **kwargs)
    return run


def _break(variant: str) -> None:
    """Patch one bug into this forked rank's runtime (never the test process's)."""
    if variant == "weight-decay-on-norms":
        stage_optim.make_optimizer = _decay_everything  # type: ignore[assignment]
    elif variant == "loss-per-sample":
        step_module.run_stage_step = _per_sample_loss(step_module.run_stage_step)  # type: ignore[assignment]
    elif variant == "block-1-allreduce-skipped":
        real_issue = GradBuckets._issue

        def issue(self: GradBuckets, bucket: Any) -> None:
            if bucket.label == "block 1":  # block 1's gradients stay per pipeline: nothing is summed
                bucket.holders = bucket.holders[:1]
            real_issue(self, bucket)

        GradBuckets._issue = issue  # type: ignore[method-assign]
    elif variant == "lone-half-without-residual":
        real_forward = DecoderLayer.forward

        def forward(self: DecoderLayer, x: torch.Tensor, rope: Any) -> torch.Tensor:
            if len(self.parts) == 1:  # a stage's lone attention or MLP half: the branch replaces the stream
                return real_forward(self, x, rope) - x
            return real_forward(self, x, rope)

        DecoderLayer.forward = forward  # type: ignore[method-assign]
    else:
        assert variant in ("correct", "correct-half-layers"), variant


VARIANTS = ("correct", "weight-decay-on-norms", "loss-per-sample", "block-1-allreduce-skipped", "correct-half-layers",
            "lone-half-without-residual")
HALF_LAYERS = ("correct-half-layers", "lone-half-without-residual")  # trained on HALF_PLAN


def _worker(rank: int, world_size: int, data: str, out_dir: str) -> None:
    originals = (stage_optim.make_optimizer, step_module.run_stage_step, GradBuckets._issue, DecoderLayer.forward)
    for variant in VARIANTS:
        (stage_optim.make_optimizer, step_module.run_stage_step, GradBuckets._issue,  # type: ignore
         DecoderLayer.forward) = originals
        _break(variant)
        config = TrainConfig(data=data, steps=STEPS, lr=LR, progress=False, timeout_s=60.0, dtype="fp64",
                             save_final=str(Path(out_dir, f"{variant}.safetensors")))
        records = train(HALF_PLAN if variant in HALF_LAYERS else PLAN, config, rank, world_size)
        if rank == 0:
            Path(out_dir, f"{variant}.json").write_text(json.dumps(records))


def test_each_check_fails_on_a_broken_runtime(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(["bugs", "must", "not", "pass", "the", "checks", "."], size=3000))], data)
    run_ranks(3, _worker, (data, str(tmp_path)), tmp_path)
    ref = reference_train(LLAMA_LIKE, data, PLAN.global_batch_size, PLAN.seq_len, STEPS, LR, weight_decay=0.1,
                          clip_grad=0.0, seed=0)
    caught: dict[str, tuple[bool, bool]] = {}
    for variant in VARIANTS:
        records = json.loads((tmp_path / f"{variant}.json").read_text())
        got = load_file(tmp_path / f"{variant}.safetensors")
        caught[variant] = (fails(lambda: assert_stats_match(variant, records, ref)),
                           fails(lambda: assert_params_match(variant, got, ref.state)))
    assert caught["correct"] == (False, False), "the real runtime must pass every check"
    assert caught["weight-decay-on-norms"][1], "weight decay on norms not caught by the parameter check"
    assert caught["loss-per-sample"][0], "a 1/samples loss scale not caught by the loss/grad-norm check"
    assert caught["block-1-allreduce-skipped"] == (True, True), caught["block-1-allreduce-skipped"]
    assert caught["correct-half-layers"] == (False, False), "a plan cut in half layers must pass every check"
    assert caught["lone-half-without-residual"] == (True, True), caught["lone-half-without-residual"]
