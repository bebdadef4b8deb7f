"""Under torchrun a rank whose peer died first says so in one line (runtime/start/launch.run_torchrun), instead of
gloo's or NCCL's own message and a crash report; any other failure is re-raised as it was."""

from __future__ import annotations

import pytest

import ethpipe.runtime.start.launch as launch
from ethpipe.runtime.config import TrainConfig

GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1 GLHF!"


@pytest.fixture()
def torchrun(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name, value in (("RANK", "2"), ("WORLD_SIZE", "3"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch, "check_plan_runnable", lambda plan, world: None)
    monkeypatch.setattr(launch, "apply_kernel_modes", lambda plan, device: None)
    monkeypatch.setattr(launch, "torchrun_store", lambda rank, world, config: None)
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "gpu-l4-01")
    return monkeypatch


def _raising(err: Exception):  # type: ignore[no-untyped-def]
    def train(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise err
    return train


def test_a_peer_loss_is_one_line_with_the_resume_advice(torchrun: pytest.MonkeyPatch) -> None:
    torchrun.setattr(launch, "train", _raising(RuntimeError(GLOO)))
    config = TrainConfig(data="x.bin", steps=2, device="cpu", checkpoint_dir="ck", auto_resume=True)
    with pytest.raises(launch.TrainingFailed) as info:
        launch.run_torchrun(None, config)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("rank 2 on gpu-l4-01 lost its connection to another rank") and "\n" not in message
    assert "torchrun's summary names it" in message and "--auto-resume" in message and "GLHF" not in message
    config = TrainConfig(data="x.bin", steps=2, device="cpu")
    with pytest.raises(launch.TrainingFailed, match="no --checkpoint-dir: the run starts over"):
        launch.run_torchrun(None, config)  # type: ignore[arg-type]


def test_any_other_failure_is_raised_as_it_was(torchrun: pytest.MonkeyPatch) -> None:
    torchrun.setattr(launch, "train", _raising(RuntimeError("CUDA out of memory")))
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        launch.run_torchrun(None, TrainConfig(data="x.bin", steps=2, device="cpu"))  # type: ignore[arg-type]
