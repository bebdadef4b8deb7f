"""`--samples documents`: every sample inside one document, padded, the loss the mean over the global batch's
counted targets; exact under any plan, also with uneven counted tokens per pipeline.

One forked 3-rank world trains (fp64, shuffled) documents of 3 to 40 tokens at 16-token samples under two plans
(two pipelines of depths 2 and 1 with ragged micro-batches; a tp-2 stage beside a depth-1 pipeline), with a
validation loss at the last step, and once more with a deliberately broken runtime that normalises the loss by
every position instead of the counted ones. Each correct run equals single-process AdamW on the same samples
(tests/dist/exactness.py's fp64 tolerances); the broken one does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import ethpipe.runtime.data as data_module
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.data import gather_samples, open_tokens, with_documents
from ethpipe.runtime.model.decoder import build_full_model
from ethpipe.runtime.train import TrainConfig, train
from ethpipe.tokens.texts import prepare_tokens

from .exactness import assert_matches_reference
from .harness import run_ranks
from .plans import LLAMA_LIKE, make_plan
from .reference import reference_train

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

STEPS, LR, SEQ = 3, 1e-3, 16
TP_PIPES = (Pipeline((Stage((0, 1), "cpu", (0, 6), 2, False),), (3, 1)),
            Pipeline((Stage((2,), "cpu", (0, 6), 1, False),), (2, 2)))
PLANS = {
    "two-pipelines": make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (3, 2, 1)), ([(2, (0, 6))], (2,))]),
    "tp2-beside-one": Plan("custom", LLAMA_LIKE.name, 8, SEQ, TP_PIPES, compute_blocks(list(TP_PIPES)),
                           model_spec=LLAMA_LIKE),
}


def _worker(rank: int, world_size: int, data: str, val: str, out_dir: str, broken: bool) -> None:
    if broken:  # every position counted, the padded ones too: a per-pipeline share of uneven data skews the loss
        data_module.TokenFile.counted_tokens = lambda self, ids, seq_len: len(ids) * seq_len  # type: ignore[method-assign]
    for name, plan in PLANS.items():
        if broken and name != "two-pipelines":
            continue
        tag = f"{name}{'-broken' if broken else ''}"
        config = TrainConfig(data=data, steps=STEPS, lr=LR, progress=False, timeout_s=60.0, dtype="fp64",
                             samples="documents", shuffle=True, clip_grad=0.5, val_data=val, eval_every=STEPS,
                             eval_batches=1, save_final=str(Path(out_dir, f"{tag}.safetensors")))
        records = train(plan, config, rank, world_size)
        if rank == 0:
            Path(out_dir, f"{tag}.json").write_text(json.dumps(records))


def _documents(rng: np.random.Generator, count: int) -> list[str]:
    words = ["doc", "ument", "pad", "mask", "token", "count", "."]
    return ["".join(rng.choice(words, size=int(rng.integers(1, 9)))) for _ in range(count)]


def test_documents_train_exactly_under_every_plan(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    data, val = tmp_path / "docs.bin", tmp_path / "val.bin"
    prepare_tokens(_documents(rng, 400), data)
    prepare_tokens(_documents(rng, 60), val)
    samples = with_documents(open_tokens(data, 256), SEQ).documents
    assert samples is not None and samples.lengths.min() < SEQ + 1 == samples.lengths.max()  # padded and whole ones
    for broken in (False, True):
        world = tmp_path / f"world-{broken}"
        world.mkdir()
        run_ranks(3, _worker, (str(data), str(val), str(tmp_path), broken), world)
    ref = reference_train(LLAMA_LIKE, str(data), 8, SEQ, STEPS, LR, weight_decay=0.1, clip_grad=0.5, seed=0,
                          shuffle=True, documents=True)
    model = build_full_model(LLAMA_LIKE, dtype=torch.float64)
    model.load_state_dict(ref.state)
    held = torch.from_numpy(gather_samples(with_documents(open_tokens(val, 256), SEQ), np.arange(8), SEQ))
    with torch.no_grad():
        logits = model(held[:, :-1].clamp_min(0))
        want_val = float(F.cross_entropy(logits.reshape(-1, 256), held[:, 1:].reshape(-1), ignore_index=-100))
    for name in PLANS:
        records = json.loads((tmp_path / f"{name}.json").read_text())
        assert_matches_reference(name, load_file(tmp_path / f"{name}.safetensors"), records, ref)
        assert records[-1]["val_loss"] == pytest.approx(want_val, rel=1e-12)
    broken = json.loads((tmp_path / "two-pipelines-broken.json").read_text())
    with pytest.raises(AssertionError):
        assert_matches_reference("broken", load_file(tmp_path / "two-pipelines-broken.safetensors"), broken, ref)
