"""``--compile``: each decoder block through torch.compile still trains exactly (fp64 scheme).

Inductor reorders floating-point operations, so a compiled run matches the eager reference to the
order-noise bound, which the float64 tolerances of ``exactness.py`` are derived from (1e-9 on every
parameter, measured floor ~3e-14): a compiled fp64 block differs from the eager one by ~1e-16 per op.
Two ranks, one pipeline of two stages with ragged micro-batches and recompute on the second stage;
``--compile`` with a tensor-parallel stage is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from ethpipe.errors import UserError
from ethpipe.plan import Stage
from ethpipe.runtime.start.checks import check_inputs
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.train import TrainConfig, train

from .exactness import assert_matches_reference
from .harness import run_ranks
from .plans import LLAMA_LIKE, make_plan
from .reference import reference_train

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _worker(rank: int, world_size: int, plan, config: TrainConfig, out: str) -> None:  # type: ignore[no-untyped-def]
    records = train(plan, config, rank, world_size)
    if rank == 0:
        Path(out).write_text(json.dumps(records))


def test_compiled_blocks_train_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(["compiled", "blocks", "train", "exactly"], size=3000))], data)
    plan = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6), "cpu", True)], (3, 2, 1))])
    config = TrainConfig(data=data, steps=3, lr=1e-3, clip_grad=0.5, progress=False, timeout_s=120.0, dtype="fp64",
                         compile=True, save_final=str(tmp_path / "w.safetensors"))
    run_ranks(2, _worker, (plan, config, str(tmp_path / "records.json")), tmp_path, deadline_s=280.0)
    ref = reference_train(LLAMA_LIKE, data, plan.global_batch_size, plan.seq_len, 3, 1e-3, weight_decay=0.1,
                          clip_grad=0.5, seed=0)
    records = json.loads((tmp_path / "records.json").read_text())
    assert_matches_reference("compiled", load_file(tmp_path / "w.safetensors"), records, ref)


def test_compile_with_a_tensor_parallel_stage_is_refused(tmp_path: Path) -> None:
    plan = make_plan(LLAMA_LIKE, [([(0, (0, 6))], (1,))])
    pipe = plan.pipelines[0]
    tp_plan = dataclasses.replace(plan, pipelines=(dataclasses.replace(pipe, stages=(
        Stage((0, 1), "cpu", (0, 6), 2),)),), blocks=(dataclasses.replace(plan.blocks[0], ranks=(0, 1)),))
    prepare_tokens(["tokens " * 100], tmp_path / "t.bin")
    with pytest.raises(UserError, match="--compile with a tensor-parallel stage"):
        check_inputs(tp_plan, TrainConfig(data=str(tmp_path / "t.bin"), steps=1, compile=True), 2)
