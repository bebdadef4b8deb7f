"""The fp16 loss scaler's policy (GradScaler's): halve on overflow, double after a run of finite steps."""

from __future__ import annotations

import pytest
import torch

from ethpipe.runtime.sync.grads import GradStats, scale_grads
from ethpipe.runtime.sync.loss_scale import INIT_SCALE, LossScaler


def test_scale_halves_on_overflow_and_doubles_after_the_growth_interval() -> None:
    scaler = LossScaler(growth_interval=3)
    assert scaler.scale == INIT_SCALE == 2.0**16
    scaler = scaler.after_step(finite=False)
    assert (scaler.scale, scaler.good_steps) == (INIT_SCALE / 2, 0)
    for expected_good in (1, 2):
        scaler = scaler.after_step(finite=True)
        assert (scaler.scale, scaler.good_steps) == (INIT_SCALE / 2, expected_good)
    scaler = scaler.after_step(finite=True)
    assert (scaler.scale, scaler.good_steps) == (INIT_SCALE, 0)
    assert LossScaler.from_dict(scaler.after_step(True).to_dict()) == LossScaler(INIT_SCALE, 1, 3)


def test_grad_stats_flag_nonfinite_and_count_owned_squares_and_unscale_in_one_launch() -> None:
    module = torch.nn.Linear(3, 2)
    module.weight.grad = torch.full((2, 3), 8.0)
    module.bias.grad = torch.tensor([3.0, 4.0])
    params = dict(module.named_parameters())
    stats = GradStats(params, ["weight"], torch.device("cpu"))()
    u = 2.0**-24  # the norm is an fp32 reduction, squared in fp64
    assert stats.dtype == torch.float64 and stats.tolist() == [pytest.approx(6 * 64.0, rel=4 * u), 0.0]  # owned only
    module.bias.grad = torch.tensor([float("inf"), 1.0])
    assert GradStats(params, ["weight"], torch.device("cpu"))().tolist() == [pytest.approx(384.0, rel=4 * u), 1.0]
    module.bias.grad = torch.tensor([float("nan"), 1.0])
    assert GradStats(params, [], torch.device("cpu"))().tolist() == [0.0, 1.0]
    scale_grads([p.grad for p in module.parameters()], 0.25)
    assert torch.equal(module.weight.grad, torch.full((2, 3), 2.0)) and torch.isnan(module.bias.grad[0])
