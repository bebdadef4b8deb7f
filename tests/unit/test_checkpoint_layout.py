"""Checkpoint directory rules without processes: commit point, discovery, pruning, config checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ethpipe.model_spec import model_presets
from ethpipe.runtime.checkpoint.layout import (
    MANIFEST, DataCursor, Manifest, check_fresh_dir, commit, complete_checkpoints, new_manifest, read_manifest,
    remove_partial, resolve_checkpoint, step_dir_name, tmp_dir_name,
)
from ethpipe.runtime.data import step_sample_ids
from ethpipe.runtime.train import TrainConfig, sample_ids

SPEC = model_presets()["tiny"]


def _save(root: Path, step: int, keep: int = 3) -> Path:
    """What rank 0 does after every rank wrote its shards."""
    tmp = root / tmp_dir_name(step)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"x" * step)
    files = {"__0_0.distcp": (step, 0)}
    manifest = new_manifest(step, DataCursor(step * 4, False, 0, 100), {"seq_len": 8}, SPEC, files)
    return commit(root, tmp, manifest, keep)


def test_commit_renames_points_latest_and_prunes(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", step_dir_name(6), step_dir_name(8)]
    assert (tmp_path / "latest").read_text().strip() == "step-00000008"
    assert resolve_checkpoint(tmp_path) == tmp_path / "step-00000008"
    assert resolve_checkpoint(tmp_path / "step-00000006") == tmp_path / "step-00000006"  # a step dir as given
    manifest = read_manifest(tmp_path / "step-00000008")
    assert manifest.step == 8 and manifest.cursor == DataCursor(32, False, 0, 100)
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_unfinished_saves_are_invisible_and_cleaned(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    (tmp_path / tmp_dir_name(4)).mkdir()  # a save killed after its shards
    (tmp_path / tmp_dir_name(4) / "__0_0.distcp").write_bytes(b"partial")
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2]
    assert resolve_checkpoint(tmp_path).name == "step-00000002"
    remove_partial(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]


def test_no_complete_checkpoint_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / tmp_dir_name(3)).mkdir()
    with pytest.raises(ValueError, match="no complete checkpoint .*unfinished save"):
        resolve_checkpoint(tmp_path)
    check_fresh_dir(tmp_path)  # only a partial save: starting fresh is fine
    _save(tmp_path, 5)
    with pytest.raises(ValueError, match="pass --resume"):
        check_fresh_dir(tmp_path)
    (tmp_path / "step-00000005" / MANIFEST).write_text("{")
    with pytest.raises(ValueError, match="corrupt ethpipe.json"):
        read_manifest(tmp_path / "step-00000005")


def test_checkpoint_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="need --checkpoint-dir"):
        TrainConfig(data="x", steps=1, resume=True)
    with pytest.raises(ValueError, match="need --checkpoint-dir"):
        TrainConfig(data="x", steps=1, save_every=2)
    with pytest.raises(ValueError, match="--keep"):
        TrainConfig(data="x", steps=1, checkpoint_dir="d", keep=0)
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(data="x", steps=1, checkpoint_dir="d", resume=True, init_from="w.safetensors")


@pytest.mark.parametrize("shuffle", [False, True])
def test_sample_cursor_continues_the_step_order(shuffle: bool) -> None:
    """Counting samples (not steps) gives the same stream, also across a change of batch size."""
    by_steps = np.concatenate([step_sample_ids(k, 6, 60, shuffle, 3) for k in range(4)])
    by_cursor = np.concatenate([sample_ids(0, 12, 60, shuffle, 3), sample_ids(12, 5, 60, shuffle, 3),
                                sample_ids(17, 7, 60, shuffle, 3)])
    assert by_cursor.tolist() == by_steps.tolist()
