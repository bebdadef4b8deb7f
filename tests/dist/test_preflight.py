"""An input problem on one node ends every rank within seconds, its cause printed once (runtime/start/preflight.py).

One forked 3-rank world: rank 2's data file is missing (as on a node without the shared disk). Before the
pre-flight exchange the other ranks waited in the first collective for the whole --timeout-s and died with a
store time-out naming nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from ethpipe.errors import ReportedElsewhere, UserError
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.train import TrainConfig, train

from .harness import run_ranks
from .plans import LLAMA_LIKE, make_plan

pytestmark = [pytest.mark.dist]

PLAN = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2,)), ([(2, (0, 6))], (2,))])
TIMEOUT_S = 120.0  # what the healthy ranks would have waited for


def _worker(rank: int, world_size: int, data: str, out_dir: str) -> None:
    path = data if rank != 2 else str(Path(data).with_name("not-on-this-node.bin"))
    started = time.monotonic()
    outcome = {"kind": "trained", "message": ""}
    try:
        train(PLAN, TrainConfig(data=path, steps=1, progress=False, timeout_s=TIMEOUT_S, dtype="fp32"), rank,
              world_size)
    except ReportedElsewhere as err:
        outcome = {"kind": "silent", "message": str(err)}
    except UserError as err:
        outcome = {"kind": "printed", "message": str(err)}
    outcome["elapsed_s"] = time.monotonic() - started  # type: ignore[assignment]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def test_one_nodes_missing_data_ends_every_rank_at_once_with_one_line(tmp_path: Path) -> None:
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(np.random.default_rng(0).choice(["a", "b", "c"], size=500))], data)
    run_ranks(3, _worker, (data, str(tmp_path)), tmp_path, deadline_s=60.0)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [o["kind"] for o in outcomes] == ["silent", "silent", "printed"]
    assert outcomes[2]["message"].startswith("rank 2 on ") and "not-on-this-node.bin' not found" in outcomes[2]["message"]
    assert "\n" not in outcomes[2]["message"]
    assert all(o["elapsed_s"] < 30.0 for o in outcomes), outcomes  # not --timeout-s
