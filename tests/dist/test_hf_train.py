"""Hugging Face models through the whole runtime: per-stage import, pipelined training, HF export.

Logits are compared in fp32 at 1e-5 (rounding floor measured <= 4e-7; see tests/unit/test_hf_import.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from ethpipe.cli.app import app
from ethpipe.hf.load import load_full, load_stage, open_hf
from ethpipe.runtime.checkpoint.weights import consolidated_weights
from ethpipe.runtime.start.launch import run_local
from ethpipe.runtime.model.decoder import build_full_model, build_stage
from ethpipe.runtime.train import TrainConfig

from .harness import run_ranks
from .plans import make_plan

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

import ethpipe.cli.commands  # noqa: E402,F401  (registers the commands on the app)

TOL = 1e-5
SEQ = 16


def _hf_model(arch: str, layers: int) -> Any:
    torch.manual_seed(0)
    t = transformers
    if arch == "llama":
        config = t.LlamaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=64, vocab_size=128, max_position_embeddings=64)
    else:
        config = t.GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=128, n_positions=64,
                              bos_token_id=0, eos_token_id=0)
    model = t.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _save(model: Any, path: Path) -> Path:
    transformers.logging.set_verbosity_error()
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    return path


def _read_own_tensors(rank: int, world_size: int, hf_dir: str, plan_json: str, out_dir: str) -> None:
    from ethpipe.plan import Plan

    plan = Plan.from_dict(json.loads(plan_json))
    pos = plan.position_of(rank)
    pipe = plan.pipelines[pos.pipeline]
    stage = build_stage(plan.resolve_model(), pipe.stages[pos.stage].layers, pos.stage == 0,
                        pos.stage == pipe.depth - 1, seed=99, sublayers=plan.sublayers)
    stats = load_stage(stage, hf_dir)
    _, full = load_full(hf_dir)
    same = all(torch.equal(v, full[k]) for k, v in stage.state_dict().items())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"tensors": stats.tensors, "bytes": stats.bytes, "files": stats.files, "same": same,
         "names": sorted(stage.state_dict())}))


def test_sharded_import_reads_only_each_ranks_own_tensors(tmp_path: Path) -> None:
    hf_dir = _save(_hf_model("llama", layers=4), tmp_path / "hf")
    ckpt = open_hf(hf_dir)
    num_files = len({t.file for t in ckpt.tensors.values()})
    assert num_files >= 8  # really sharded
    plan = make_plan(ckpt.spec, [([(0, (0, 1)), (1, (1, 2)), (2, (2, 3)), (3, (3, 4))], (1, 1, 1, 1))], seq_len=SEQ)
    out = tmp_path / "reads"
    out.mkdir()
    run_ranks(4, _read_own_tensors, (str(hf_dir), plan.to_json(), str(out)), tmp_path)
    reads = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    total = ckpt.total_bytes
    for r, got in enumerate(reads):
        assert got["same"], f"rank {r} loaded other values than the checkpoint's"
        assert got["tensors"] == len(got["names"])  # Llama: one HF tensor per ethpipe tensor, nothing else
        assert got["bytes"] < 0.5 * total and got["files"] < num_files
        print(f"rank {r}: read {got['tensors']} tensors, {got['bytes']} of {total} bytes, "
              f"{got['files']} of {num_files} files")
    assert sum(g["bytes"] for g in reads) == total  # one pipeline, untied: every tensor read exactly once
    assert sum(g["tensors"] for g in reads) == len(ckpt.tensors)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: tied embeddings, the last stage holds a copy
def test_train_from_hf_then_export_to_hf(arch: str, tmp_path: Path) -> None:
    original = _hf_model(arch, layers=4)
    hf_dir = _save(original, tmp_path / "hf")
    spec = open_hf(hf_dir).spec
    plan = make_plan(spec, [([(0, (0, 2)), (1, (2, 4))], (2, 2)), ([(2, (0, 1)), (3, (1, 4))], (2,))], seq_len=SEQ)
    tokens = np.random.default_rng(5).integers(0, spec.vocab_size, size=20 * SEQ + 1).astype(np.uint16)
    tokens.tofile(tmp_path / "tokens.bin")
    config = TrainConfig(data=str(tmp_path / "tokens.bin"), steps=2, lr=1e-2, init_from=str(hf_dir),
                         checkpoint_dir=str(tmp_path / "ckpt"), progress=False)
    records = run_local(plan, config)

    # step 0's loss is the HF model's own loss on the first global batch: the import really loaded it
    batch = torch.from_numpy(tokens[: 6 * SEQ + 1].astype(np.int64))
    samples = torch.stack([batch[i * SEQ: i * SEQ + SEQ + 1] for i in range(6)])
    with torch.no_grad():
        logits = original(samples[:, :-1]).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, spec.vocab_size), samples[:, 1:].reshape(-1)).item()
    assert abs(records[0]["loss"] - hf_loss) <= TOL, (records[0]["loss"], hf_loss)

    result = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), "--format", "hf", "--out",
                                      str(tmp_path / "out"), "--max-shard-size", "30KB"])
    assert result.exit_code == 0, result.output
    _, _, state = consolidated_weights(tmp_path / "ckpt")
    ours = build_full_model(spec)
    ours.load_state_dict(state)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    probe = torch.randint(0, spec.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        diff = (ours.eval()(probe) - theirs.eval()(probe).logits).abs().max().item()
        moved = (ours(probe) - original(probe).logits).abs().max().item()
    print(f"{arch}: trained ethpipe vs exported HF max |logit difference| = {diff:.3g} "
          f"(training moved them {moved:.3g})")
    assert diff <= TOL
    assert moved > 1e-2  # the exported weights are the trained ones, not the imported ones
