"""`data prepare --val-fraction`: held-out tokens at a document boundary; `train --eval-every` needs them; the
validation loss in the console line and on the dashboards."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.cli.app import app
from ethpipe.errors import UserError
from ethpipe.runtime.config import TrainConfig
from ethpipe.runtime.observe.metrics import MetricsWriter
from ethpipe.runtime.observe.sinks import scalars
from ethpipe.tokens.split import split_validation, val_path
from ethpipe.tokens.texts import prepare_tokens


def test_the_split_cuts_at_a_document_and_keeps_every_token(tmp_path: Path) -> None:
    docs = [f"document {k} " + "word " * (10 + k) for k in range(40)]
    out = tmp_path / "tokens.bin"
    total = prepare_tokens(docs, out)
    whole = np.fromfile(out, dtype=np.uint16).copy()  # byte-level: vocab 256 in uint16
    kept, held = split_validation(out, 0.25)
    assert kept + held == total and abs(held / total - 0.25) < 0.05
    train, val = np.fromfile(out, dtype=np.uint16), np.fromfile(val_path(out), dtype=np.uint16)
    assert np.array_equal(np.concatenate([train, val]), whole)  # nothing lost, nothing doubled
    assert bytes(val[:9].astype(np.uint8)) == b"document " and bytes(train[-2:].astype(np.uint8)) == b"\n\n"
    assert json.loads((tmp_path / "tokens.bin.json").read_text())["num_tokens"] == kept
    assert json.loads((tmp_path / "tokens.val.bin.json").read_text())["num_tokens"] == held


def test_the_cli_writes_both_files_and_bad_fractions_are_one_line(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join("paragraph " * 20 for _ in range(30)))
    res = CliRunner().invoke(app, ["data", "prepare", "--text", str(text), "--out", str(tmp_path / "d.bin"),
                                   "--val-fraction", "0.1", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "d.val.bin").is_file() and "--val-data" in res.output
    bad = CliRunner().invoke(app, ["data", "prepare", "--text", str(text), "--out", str(tmp_path / "e.bin"),
                                   "--val-fraction", "1.5", "--no-progress"])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1 and "--val-fraction" in bad.output
    assert not (tmp_path / "e.bin").exists()  # nothing half-written


def test_eval_every_needs_val_data() -> None:
    with pytest.raises(UserError, match="--eval-every needs --val-data"):
        TrainConfig(data="x.bin", steps=2, eval_every=1)
    with pytest.raises(UserError, match="--eval-batches"):
        TrainConfig(data="x.bin", steps=2, eval_batches=0, val_data="v.bin")


def test_the_validation_loss_is_printed_and_logged() -> None:
    out = io.StringIO()
    writer = MetricsWriter(None, 3, progress=True, interactive=False, out=out, log_every_s=1e9)
    for step, val in ((1, None), (2, 2.5), (3, None)):
        record = {"step": step, "loss": 3.0, "tokens_per_s": 1.0, "iteration_time_s": 0.5}
        if val is not None:
            record["val_loss"] = val
        writer.write(record)
    writer.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]  # the first, the validation, the last
    assert "val loss 2.5000" in lines[1] and "val loss" not in lines[0]
    assert scalars({"step": 2, "val_loss": 2.5})["val/loss"] == 2.5


@pytest.mark.parametrize("extra, message", [
    (["--eval-every", "2"], "--eval-every needs --val-data FILE"),
    (["--samples", "documents"], "has no document index"),
    (["--adam-beta2", "1.5"], "--adam-beta1/--adam-beta2 must be in [0, 1)"),
    (["--lr-schedule", "step"], "--lr-schedule must be one of constant, cosine, linear, wsd"),
])
def test_train_refuses_in_one_line(tmp_path: Path, extra: list[str], message: str) -> None:
    from ethpipe.tokens.format import documents_path

    plan = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", "--cluster", "examples/clusters/cpu_demo.yaml", "--model", "tiny",
                                   "--global-batch", "6", "--seq-len", "32", "--max-tp", "1", "--dtype", "fp32",
                                   "--out", str(plan)])
    assert res.exit_code == 0, res.output
    data = tmp_path / "t.bin"
    prepare_tokens(["some text " * 200], data)
    documents_path(data).unlink()
    res = CliRunner().invoke(app, ["train", "--plan", str(plan), "--data", str(data), "--steps", "1", *extra])
    assert res.exit_code == 2 and message in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert "Traceback" not in res.output
