"""Bad Hugging Face inputs on the command line: one line, exit code 2, checked before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from _hf_models import make_model, save_model

pytest.importorskip("transformers")

import ethpipe.cli.commands  # noqa: E402,F401  (registers the commands on the app)
from ethpipe.cli.app import app  # noqa: E402
from ethpipe.hf.load import open_hf  # noqa: E402
from ethpipe.model_load import load_model_spec  # noqa: E402
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks  # noqa: E402


def _one_line_exit_2(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    out = (result.stdout or "") + (result.stderr or "")
    assert result.exit_code == 2, out
    assert len(out.strip().splitlines()) == 1 and out.startswith("error:"), out
    return out


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, Path]:
    hf = save_model(make_model("llama"), tmp_path / "hf", sharded=True)
    spec = open_hf(hf).spec
    pipes = (Pipeline((Stage((0,), "cpu", (0, 1), 1, False), Stage((1,), "cpu", (1, 2), 1, False)), (2,)),)
    Plan("custom", spec.name, 2, 8, pipes, compute_blocks(pipes), model_spec=spec).save(tmp_path / "plan.json")
    np.random.default_rng(0).integers(0, 128, size=200).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    return {"hf": hf, "plan": tmp_path / "plan.json", "data": tmp_path / "tokens.bin", "dir": tmp_path}


def _train(setup: dict[str, Path], init_from: Path, plan: Path | None = None) -> str:
    return _one_line_exit_2(["train", "--plan", str(plan or setup["plan"]), "--data", str(setup["data"]),
                             "--steps", "1", "--no-progress", "--init-from", str(init_from)])


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_directory_without_config(setup: dict[str, Path]) -> None:
    empty = setup["dir"] / "empty"
    empty.mkdir()
    assert "has no config.json" in _train(setup, empty)


def test_unsupported_architecture(setup: dict[str, Path]) -> None:
    _edit_config(setup["hf"], model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    out = _train(setup, setup["hf"])
    assert "gpt_neox" in out and "not supported" in out and "llama" in out
    assert "not supported" in _one_line_exit_2(["plan", "--cluster", "examples/clusters/cpu_demo.yaml", "--model",
                                                 str(setup["hf"]), "--global-batch", "8", "--seq-len", "16",
                                                 "--out", str(setup["dir"] / "p.json")])


def test_shapes_that_disagree_with_the_config(setup: dict[str, Path]) -> None:
    _edit_config(setup["hf"], intermediate_size=80)
    assert "the weights and the config disagree" in _train(setup, setup["hf"])


def test_truncated_safetensors(setup: dict[str, Path]) -> None:
    shard = sorted(setup["hf"].glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert "truncated or corrupt" in _train(setup, setup["hf"])


def test_plan_of_another_model(setup: dict[str, Path]) -> None:
    spec = load_model_spec("tiny")
    pipes = (Pipeline((Stage((0,), "cpu", (0, 8), 1, False),), (2,)),)
    Plan("custom", "tiny", 2, 8, pipes, compute_blocks(pipes), model_spec=spec).save(setup["dir"] / "tiny.json")
    out = _train(setup, setup["hf"], plan=setup["dir"] / "tiny.json")
    assert "num_layers=2" in out and f"plan with --model {setup['hf']}" in out


def test_plan_from_a_hf_directory_uses_its_config(setup: dict[str, Path]) -> None:
    result = CliRunner().invoke(app, ["plan", "--cluster", "examples/clusters/cpu_demo.yaml", "--model",
                                      str(setup["hf"]), "--global-batch", "8", "--seq-len", "16", "--max-tp", "1",
                                      "--out", str(setup["dir"] / "p.json")])
    assert result.exit_code == 0, result.output
    assert Plan.load(setup["dir"] / "p.json").resolve_model() == open_hf(setup["hf"]).spec


def test_export_bad_options(setup: dict[str, Path]) -> None:
    full = setup["dir"] / "full"
    full.mkdir()
    (full / "x").write_text("keep")
    base = ["export", str(setup["dir"] / "no-ckpt"), "--format", "hf", "--out"]
    assert "--format must be" in _one_line_exit_2([*base[:3], "onnx", "--out", str(setup["dir"] / "o")])
    assert "--max-shard-size" in _one_line_exit_2([*base, str(setup["dir"] / "o"), "--max-shard-size", "5XB"])
    assert "not an empty directory" in _one_line_exit_2([*base, str(full)])
    _one_line_exit_2([*base, str(setup["dir"] / "o")])  # no checkpoint there
    assert (full / "x").read_text() == "keep" and not (setup["dir"] / "o").exists()
