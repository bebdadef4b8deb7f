"""The fp16 loss scaler's policy (GradScaler's): halve on overflow, double after a run of finite steps."""

from __future__ import annotations

import torch

from ethpipe.runtime.loss_scale import INIT_SCALE, LossScaler, count_nonfinite, unscale_gradients


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


def test_nonfinite_count_and_unscale() -> None:
    module = torch.nn.Linear(3, 2)
    module.weight.grad = torch.full((2, 3), 8.0)
    module.bias.grad = torch.tensor([float("inf"), float("nan")])
    assert count_nonfinite(module) == 2
    unscale_gradients(module, 4.0)
    assert torch.equal(module.weight.grad, torch.full((2, 3), 2.0))
    assert torch.isinf(module.bias.grad[0]) and torch.isnan(module.bias.grad[1])
