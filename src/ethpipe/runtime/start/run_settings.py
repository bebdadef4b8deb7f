"""The training settings a checkpoint records, and what a resume changes (runs that can be audited).

Every checkpoint's manifest carries the settings that shape the optimisation (``extra["settings"]``); a
resume prints where it continues from and every setting it changes, old -> new, and ``--strict-resume``
refuses any change. A plan change is reported, never refused: checkpoints load under any plan.
"""

from __future__ import annotations

import os
from typing import Any

from ethpipe.atomic import write_text_atomic
from ethpipe.errors import UserError
from ethpipe.plan import Plan
from ethpipe.runtime.checkpoint.layout import Manifest
from ethpipe.runtime.config import TrainConfig

RUN_CONFIG_NAME = "run.toml"  # the options of the run that wrote a checkpoint directory (`train --config` reads it)
SETTINGS = ("lr", "lr_schedule", "warmup_steps", "min_lr_ratio", "decay_fraction", "adam_betas", "adam_eps",
            "weight_decay", "clip_grad", "seed", "shuffle", "samples")


def run_settings(config: TrainConfig, dtype: str) -> dict[str, Any]:
    """What a checkpoint records: the optimisation settings, the precision and the data file's name."""
    values = {k: getattr(config, k) for k in SETTINGS}
    values["adam_betas"] = list(values["adam_betas"])  # as JSON keeps it: a resume compares like with like
    return {**values, "dtype": dtype, "data": os.path.basename(config.data)}


def changed_settings(manifest: Manifest, config: TrainConfig, dtype: str) -> list[str]:
    """``name old -> new`` for every recorded setting this run changes (none recorded: an older checkpoint)."""
    saved = manifest.extra.get("settings") or {}
    now = run_settings(config, dtype)
    return [f"{k} {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]


def _plan_change(old: dict[str, Any], plan: Plan) -> str:
    new = plan.to_dict()
    if [old.get(k) for k in ("pipelines", "global_batch_size")] == [new.get(k) for k in ("pipelines", "global_batch_size")]:
        return "same plan"
    ranks = sum(len(s["ranks"]) for p in old.get("pipelines", []) for s in p["stages"])
    return (f"plan changed: {ranks} -> {plan.world_size} ranks, {len(old.get('pipelines', []))} -> "
            f"{len(plan.pipelines)} pipelines, batch {old.get('global_batch_size')} -> {plan.global_batch_size}")


def resume_line(manifest: Manifest, plan: Plan, config: TrainConfig, dtype: str) -> str:
    """One line: the step resumed from, the plan change, the settings changed."""
    changes = changed_settings(manifest, config, dtype)
    return (f"resumed from step {manifest.step} ({_plan_change(manifest.plan, plan)}); "
            + (f"settings changed: {', '.join(changes)}" if changes else "settings unchanged"))


def check_strict_resume(manifest: Manifest, config: TrainConfig, dtype: str) -> None:
    changes = changed_settings(manifest, config, dtype)
    if changes:
        raise UserError(f"--strict-resume: this run changes {', '.join(changes)} from the checkpoint at step "
                        f"{manifest.step}: pass the checkpoint's values, or drop --strict-resume")


def write_run_config(text: str, checkpoint_dir: str) -> None:
    """Keep the run's options beside its checkpoints: ``train --config DIR/run.toml`` repeats the run."""
    write_text_atomic(os.path.join(checkpoint_dir, RUN_CONFIG_NAME), text)


REPLANNED_PLAN_NAME = "plan-replanned.json"  # the plan a `--replan-after` switch chose


def replanned_path(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, REPLANNED_PLAN_NAME)


def write_replanned_plan(plan: Plan, checkpoint_dir: str | None) -> str:
    """Keep the switched-to plan beside its checkpoints: a restart after a crash resumes with it (``--plan``)."""
    assert checkpoint_dir is not None, "a plan switch goes through a checkpoint"
    path = replanned_path(checkpoint_dir)
    plan.save(path)
    return path


def with_plan(run_config: str | None, plan_path: str) -> str | None:
    """``run.toml``'s text naming ``plan_path`` as the plan (after a ``--replan-after`` switch: the run goes on,
    and is repeated, with the re-planned plan); its comment lines are kept."""
    if run_config is None:
        return None
    import tomllib

    import tomli_w

    header = "".join(line + "\n" for line in run_config.splitlines() if line.startswith("#"))
    return header + tomli_w.dumps({**tomllib.loads(run_config), "plan": plan_path})
