"""UserError vs bugs: bad input is one line and exit 2; anything else keeps its traceback (exit 1);
planners drop only Infeasible candidates, so a bug in pricing one propagates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

import ethpipe.cli.commands  # noqa: F401  (registers the commands on the app)
from ethpipe import planner
from ethpipe.cli.app import app, user_errors
from ethpipe.cluster import cluster_from_dict, load_cluster
from ethpipe.cost.model import CostModel
from ethpipe.errors import CRASH_DIR_ENV, Infeasible, UserError
from ethpipe.model_load import load_model_spec
from ethpipe.planner import make_plan
from ethpipe.planner.baselines import exhaustive
from ethpipe.planner.devices import combine, eth, grouping, replicated
from ethpipe.runtime.start import launch

DEMO = "examples/clusters/cpu_demo.yaml"
PLAN_ARGS = ["plan", "--cluster", DEMO, "--model", "tiny", "--global-batch", "24", "--seq-len", "64", "--max-tp", "1"]
HETERO = cluster_from_dict({"nodes": [
    {"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 800},
    {"gpu": "v100_32gb_sxm2", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 400}]})


def _lines(output: str) -> list[str]:
    return [line for line in output.strip().splitlines() if line.strip()]


def _raiser(err: BaseException):  # type: ignore[no-untyped-def]
    def broken(*_: object, **__: object) -> None:
        raise err

    return broken


@pytest.mark.parametrize("bug", [ValueError("injected bug"), RuntimeError("injected bug")], ids=["ValueError",
                                                                                                  "RuntimeError"])
def test_cli_bug_exits_1_and_keeps_its_traceback(bug: Exception, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CRASH_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(planner, "make_plan", _raiser(bug))
    res = CliRunner().invoke(app, PLAN_ARGS, env={"COLUMNS": "80"})
    assert res.exit_code == 1, res.output
    lines = _lines(res.output)
    assert len(lines) == 1 and f"{type(bug).__name__}: injected bug" in lines[0] and "Traceback" not in res.output
    (report,) = tmp_path.glob("ethpipe-crash-*.txt")
    assert str(report) in lines[0]
    kept = report.read_text()
    assert "Traceback" in kept and "in broken" in kept and f"{type(bug).__name__}: injected bug" in kept


def test_cli_bad_input_still_exits_2_with_one_line_and_no_report(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CRASH_DIR_ENV, str(tmp_path))
    res = CliRunner().invoke(app, [*PLAN_ARGS, "--method", "best"])
    assert res.exit_code == 2 and len(_lines(res.output)) == 1 and "unknown method" in res.output
    assert not list(tmp_path.iterdir())


def test_train_crash_and_train_bug_exit_1_naming_the_kept_file(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CRASH_DIR_ENV, str(tmp_path / "crashes"))
    plan = tmp_path / "plan.json"
    make_plan(load_cluster(DEMO), load_model_spec("tiny"), 24, 64, max_tp=1).save(plan)
    args = ["train", "--plan", str(plan), "--data", str(tmp_path / "t.bin"), "--steps", "1", "--no-progress"]
    failed = launch.TrainingFailed("training failed on rank 1: RuntimeError: boom (traceback in /x/c.txt)")
    monkeypatch.setattr(launch, "run_local", _raiser(failed))
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1 and _lines(res.output) == ["error: " + str(failed)], res.output
    monkeypatch.setattr(launch, "run_local", _raiser(KeyError("lost")))
    res = CliRunner().invoke(app, args)
    (report,) = (tmp_path / "crashes").glob("ethpipe-crash-*.txt")
    assert res.exit_code == 1 and len(_lines(res.output)) == 1 and str(report) in res.output
    assert "KeyError: 'lost'" in report.read_text()


@pytest.mark.parametrize("message", ["pip install 'ethpipe[hf]'", "emulation[0][key] must be [fwd_s, bwd_s]",
                                     "cluster file 'a[/b].yaml' not found"])
def test_error_lines_print_brackets_as_text(message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rich would read `[hf]` as markup and drop it (the hint then names the wrong package) or, for `[/b]`, crash."""
    monkeypatch.setattr(planner, "make_plan", _raiser(UserError(message)))
    res = CliRunner().invoke(app, PLAN_ARGS, env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    assert _lines(res.output) == [f"error: {message}"]


def test_user_errors_lets_typer_control_flow_through() -> None:
    @user_errors
    def stop() -> None:
        raise typer.Exit(3)

    with pytest.raises(typer.Exit):
        stop()


def test_pydantic_errors_become_user_errors() -> None:
    with pytest.raises(UserError, match="cluster spec field 'nodes.0.num_nodes'"):
        cluster_from_dict({"nodes": [{"gpu": "t4", "num_nodes": 0, "gpus_per_node": 1, "nic_gbit_s": 1}]})


def test_local_worker_sends_user_errors_back_and_keeps_crashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (no spawn): a UserError becomes the error file (exit 2); a plain ValueError is a crash whose
    traceback ``_failure`` copies to a kept report named in its one line."""
    monkeypatch.setenv(CRASH_DIR_ENV, str(tmp_path / "crashes"))
    monkeypatch.setattr(launch, "die_with_parent", lambda: None)
    monkeypatch.setattr(launch, "pick_device", lambda *_: torch.device("cpu"))
    run_dir, threads = tmp_path / "run", torch.get_num_threads()
    run_dir.mkdir()
    monkeypatch.setattr(launch, "train", _raiser(UserError("--steps must be at least 1, got 0")))
    with pytest.raises(SystemExit) as stopped:
        launch._local_worker(1, None, None, 2, str(run_dir), threads)  # type: ignore[arg-type]
    assert stopped.value.code == 2 and (run_dir / "error-00001.txt").read_text().startswith("--steps")
    (run_dir / "error-00001.txt").unlink()
    monkeypatch.setattr(launch, "train", _raiser(ValueError("a bug, not bad input")))
    with pytest.raises(ValueError, match="a bug"):
        launch._local_worker(1, None, None, 2, str(run_dir), threads)  # type: ignore[arg-type]
    assert not list(run_dir.glob("error-*.txt"))
    failure = launch._failure([], run_dir)
    assert failure.report is not None and failure.report.parent == tmp_path / "crashes"
    assert "rank 1" in str(failure) and str(failure.report) in str(failure) and len(str(failure).splitlines()) == 1
    assert "Traceback" in failure.report.read_text() and "ValueError: a bug" in failure.report.read_text()


def _flaky_pricing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first candidate priced hits a bug (a plain ValueError); the others price normally."""
    real = grouping.group_iteration_s
    calls = [0]

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            raise ValueError("injected pricing bug")
        return real(*args, **kwargs)

    monkeypatch.setattr(grouping, "group_iteration_s", flaky)


def test_a_pricing_bug_in_one_candidate_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_model_spec("gpt3-1.3b")
    for catch_all in (True, False):  # True: the old `except ValueError`, which returned another plan
        with monkeypatch.context() as patch:
            _flaky_pricing(patch)
            if catch_all:
                for module in (eth, combine, replicated, exhaustive):
                    patch.setattr(module, "Infeasible", ValueError)
                assert make_plan(HETERO, spec, 64, 2048, max_tp=1).world_size == 8
                _flaky_pricing(patch)
                assert exhaustive.exhaustive_eth(CostModel(HETERO, spec, 2048), 64, max_tp=1).plan is not None
                continue
            with pytest.raises(ValueError, match="injected pricing bug") as err:
                make_plan(HETERO, spec, 64, 2048, max_tp=1)
            assert not isinstance(err.value, UserError)
            _flaky_pricing(patch)
            with pytest.raises(ValueError, match="injected pricing bug"):
                exhaustive.exhaustive_eth(CostModel(HETERO, spec, 2048), 64, max_tp=1)


def test_when_nothing_is_feasible_the_reason_is_one_infeasible_line() -> None:
    t4 = cluster_from_dict({"nodes": [{"gpu": "t4", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100}]})
    with pytest.raises(Infeasible, match=r"llama2-70b needs .* per stage at depth 8 on t4") as err:
        make_plan(t4, load_model_spec("llama2-70b"), 64, 4096, dtype="fp16")
    assert "\n" not in str(err.value)
    with pytest.raises(Infeasible, match="smaller than the"):
        make_plan(load_cluster("examples/clusters/a100_v100.yaml"), load_model_spec("tiny"), 1, 64, max_tp=1)


def test_help_shows_the_extras_to_install() -> None:
    """rich reads '[tensorboard]' as markup: the help said 'needs ethpipe.'"""
    from typer.testing import CliRunner

    from ethpipe.cli.app import app

    out = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "250"}).output
    assert "ethpipe[tensorboard]" in out and "ethpipe[wandb]" in out


def test_a_piped_heading_is_a_line_not_a_hundred_thousand_characters(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`ethpipe demo | tee log` started with a 100,000-character rule (piped consoles are PIPED_WIDTH wide)."""
    import importlib
    import io

    from rich.console import Console

    app_module = importlib.import_module("ethpipe.cli.app")  # the module (the package's `app` is the Typer app)

    piped = Console(width=app_module.PIPED_WIDTH, file=io.StringIO())
    monkeypatch.setattr(app_module, "console", piped)
    app_module.heading("ethpipe demo")
    (line,) = piped.file.getvalue().splitlines()
    assert len(line) == app_module.HEADING_WIDTH and "ethpipe demo" in line


def test_a_memory_error_names_every_type_of_the_binding_memory_and_the_recompute_flag() -> None:
    """Two types with the same memory: both named (one of them read as the only culprit); recompute off: the flag
    that turns it on, not a description of it."""
    from ethpipe.cluster import cluster_from_dict
    from ethpipe.cost.model import CostModel
    from ethpipe.model_load import load_model_spec
    from ethpipe.planner.assemble import memory_error

    cluster = cluster_from_dict({"nodes": [{"gpu": g, "num_nodes": 1, "gpus_per_node": 1, "nic_gbit_s": 100}
                                           for g in ("v100_16gb", "t4")]})
    text = str(memory_error(CostModel(cluster, load_model_spec("llama2-70b"), 4096), "never"))
    assert "on v100_16gb / t4" in text or "on t4 / v100_16gb" in text, text
    assert text.endswith("use more nodes or --recompute always"), text


def test_the_cause_is_reported_not_a_peer_that_saw_it_leave(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crashed rank tears its groups down before writing its report, so its peer's 'Connection closed by peer'
    can be written first: the report names the crashed rank's own error."""
    monkeypatch.setenv(CRASH_DIR_ENV, str(tmp_path / "crashes"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "crash-00000000000000000001-00000.txt").write_text(
        "rank 0: Traceback (most recent call last):\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]")
    (run_dir / "crash-00000000000000000002-00001.txt").write_text(
        "rank 1: Traceback (most recent call last):\nRuntimeError: injected failure on the last stage")
    failure = launch._failure([], run_dir)
    assert "rank 1" in str(failure) and "injected failure" in str(failure), str(failure)
    (run_dir / "crash-00000000000000000002-00001.txt").unlink()  # only consequences: the earliest still
    assert "rank 0" in str(launch._failure([], run_dir))
