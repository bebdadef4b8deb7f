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
