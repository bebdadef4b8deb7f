"""Checkpoints record the run's settings; a resume says what it changes, and --strict-resume refuses."""

from __future__ import annotations

import dataclasses

import pytest

from ethpipe.errors import UserError
from ethpipe.runtime.checkpoint.layout import DataCursor, Manifest, new_manifest
from ethpipe.runtime.config import TrainConfig
from ethpipe.runtime.start.run_settings import changed_settings, check_strict_resume, resume_line, run_settings

from test_plan_format import BASE
from ethpipe.plan import Plan


def _manifest(config: TrainConfig, plan: Plan) -> Manifest:
    spec = plan.resolve_model()
    saved = new_manifest(100, DataCursor(1000, False, 0, 5000), plan.to_dict(), spec, {},
                         extra={"dtype": "fp32", "settings": run_settings(config, "fp32")})
    return Manifest.from_json(saved.to_json())  # what a resume reads back


def test_a_resume_names_every_changed_setting_and_the_plan_change() -> None:
    plan = Plan.from_dict(dict(BASE))
    before = TrainConfig(data="/data/tokens.bin", steps=100, lr=1e-3, clip_grad=1.0)
    manifest = _manifest(before, plan)
    assert changed_settings(manifest, dataclasses.replace(before, steps=200), "fp32") == []  # steps may grow
    after = dataclasses.replace(before, steps=200)  # the default lr: the silent change users hit
    after = dataclasses.replace(after, lr=3e-4, clip_grad=0.0)
    line = resume_line(manifest, plan, after, "bf16")
    assert line == ("resumed from step 100 (same plan); settings changed: lr 0.001 -> 0.0003, "
                    "clip_grad 1.0 -> 0.0, dtype fp32 -> bf16")
    smaller = Plan.from_dict({**BASE, "pipelines": BASE["pipelines"][:1], "global_batch_size": 6,
                              "blocks": [{"layers": [0, 3], "ranks": [0]}, {"layers": [3, 8], "ranks": [1]}]})
    assert "plan changed: 4 -> 2 ranks, 2 -> 1 pipelines, batch 10 -> 6" in resume_line(manifest, smaller, before,
                                                                                        "fp32")
    with pytest.raises(UserError, match="--strict-resume: this run changes lr 0.001 -> 0.0003") as err:
        check_strict_resume(manifest, after, "fp32")
    assert "\n" not in str(err.value)
    check_strict_resume(manifest, before, "fp32")  # nothing changed: fine
    old = dataclasses.replace(manifest, extra={})  # a checkpoint from before settings were recorded
    assert changed_settings(old, after, "fp32") == [] and "settings unchanged" in resume_line(old, plan, after, "fp32")


def test_a_resume_continues_with_the_checkpoints_settings_unless_told(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`train --resume` without --lr kept 'lr 0.001 -> 0.0003' (the default) and went on; now every recorded
    setting not given comes from the checkpoint, and a given one stays (a change the start line reports)."""
    from types import SimpleNamespace

    from ethpipe.cli.train_cmds import settings_of_the_checkpoint
    from ethpipe.runtime.checkpoint.layout import MANIFEST, step_dir_name

    plan = Plan.from_dict(dict(BASE))
    before = TrainConfig(data="/data/tokens.bin", steps=100, lr=1e-3, clip_grad=1.0, shuffle=True, seed=7)
    step_dir = tmp_path / step_dir_name(100)
    step_dir.mkdir()
    (step_dir / MANIFEST).write_text(_manifest(before, plan).to_json())

    class Ctx:
        def __init__(self, given: set[str]) -> None:
            self.given = given

        def get_parameter_source(self, name: str):  # type: ignore[no-untyped-def]
            return SimpleNamespace(name="COMMANDLINE" if name in self.given else "DEFAULT")

    resumed = TrainConfig(data="/data/tokens.bin", steps=200, checkpoint_dir=str(tmp_path), resume=True)
    got = settings_of_the_checkpoint(Ctx(set()), resumed)
    assert (got.lr, got.clip_grad, got.shuffle, got.seed, got.steps) == (1e-3, 1.0, True, 7, 200)
    assert changed_settings(_manifest(before, plan), got, "fp32") == []
    told = settings_of_the_checkpoint(Ctx({"lr"}), dataclasses.replace(resumed, lr=5e-4))
    assert (told.lr, told.clip_grad) == (5e-4, 1.0)
    fresh = settings_of_the_checkpoint(Ctx(set()), dataclasses.replace(resumed, resume=False))
    assert fresh.lr == resumed.lr  # no resume: the defaults stand


def test_after_a_plan_switch_run_toml_names_the_new_plan() -> None:
    import tomllib

    from ethpipe.runtime.start.run_settings import with_plan

    text = "# the options of an `ethpipe train` run\nplan = \"old.json\"\nsteps = 10\nlr = 0.001\n"
    new = with_plan(text, "/ckpt/plan-replanned.json")
    assert new is not None and new.startswith("# the options of an `ethpipe train` run\n")
    assert tomllib.loads(new) == {"plan": "/ckpt/plan-replanned.json", "steps": 10, "lr": 0.001}
    assert with_plan(None, "x") is None


def test_the_lr_schedules_and_adamw_settings() -> None:
    """Warm-up then constant, cosine, linear or warmup-stable-decay to lr x min_lr_ratio; the AdamW settings reach
    torch's optimizer; bad values are one line each."""
    import math

    import pytest
    import torch

    from ethpipe.errors import UserError
    from ethpipe.runtime.config import TrainConfig, lr_at, make_optimizer

    def lrs(schedule: str, **kw: object) -> list[float]:
        config = TrainConfig(data="x.bin", steps=10, lr=1.0, warmup_steps=2, lr_schedule=schedule,  # type: ignore[arg-type]
                             min_lr_ratio=0.1, **kw)
        return [lr_at(config, s) for s in range(10)]

    assert lrs("constant") == [0.5, 1.0] + [1.0] * 8
    assert lrs("linear")[2] == 1.0 and lrs("linear")[-1] == pytest.approx(0.1)
    assert lrs("cosine")[-1] == pytest.approx(0.1) and lrs("cosine")[2] == 1.0
    wsd = lrs("wsd", decay_fraction=0.25)  # 8 steps after warm-up: the last 2 decay
    assert wsd == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1])
    assert all(not math.isnan(x) for x in lrs("wsd", decay_fraction=1.0))
    module = torch.nn.Linear(2, 2)
    opt = make_optimizer(module, TrainConfig(data="x.bin", steps=1, adam_betas=(0.8, 0.99), adam_eps=1e-6))
    assert opt.defaults["betas"] == (0.8, 0.99) and opt.defaults["eps"] == 1e-6
    for bad in (dict(lr_schedule="step"), dict(adam_betas=(1.0, 0.9)), dict(adam_eps=0.0), dict(min_lr_ratio=2.0),
                dict(decay_fraction=0.0)):
        with pytest.raises(UserError):
            TrainConfig(data="x.bin", steps=1, **bad)  # type: ignore[arg-type]
