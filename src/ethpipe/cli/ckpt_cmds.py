"""`ethpipe export` (checkpoint -> one consolidated state-dict file) and `ethpipe inspect`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from ethpipe.cli.app import app, console, user_errors
from ethpipe.units import format_bytes


@app.command("export")
@user_errors
def export(
    checkpoint: Path = typer.Argument(..., help="A --checkpoint-dir (its newest checkpoint) or one step-N directory."),
    out: Path = typer.Option(..., "--out", help="ethpipe: output file (.safetensors, else torch.save format); "
                                                "hf: a new directory."),
    fmt: str = typer.Option("ethpipe", "--format", help="ethpipe (one state dict, global names) or hf (a Hugging "
                                                        "Face model directory for from_pretrained)."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="With --format hf: largest safetensors "
                                                                       "shard (e.g. 5GB, 500MB, 2GiB)."),
) -> None:
    """Write the checkpoint's model weights: as one state dict with global names (loads with
    `ethpipe train --init-from` and into `ethpipe.build_model(...)` via load_state_dict), or as a
    Hugging Face directory (config.json, sharded safetensors, index) for
    `transformers.AutoModelForCausalLM.from_pretrained`."""
    from ethpipe.errors import UserError
    from ethpipe.runtime.ckpt_state import consolidated_weights, export_checkpoint

    if fmt not in ("ethpipe", "hf"):
        raise UserError(f"--format must be ethpipe or hf, got {fmt!r}")
    if fmt == "ethpipe":
        manifest = export_checkpoint(checkpoint, out)
        console.print(f"wrote the weights of step {manifest.step} ({manifest.model_spec['name']}) to {out}")
        return
    from ethpipe.hf.config import hf_architecture_of
    from ethpipe.hf.export import check_out_dir, export_hf, parse_size
    from ethpipe.model_spec import spec_from_dict
    from ethpipe.runtime.ckpt_layout import read_manifest, resolve_checkpoint

    parse_size(max_shard_size)  # every cheap check before the weights are read
    check_out_dir(out)
    hf_architecture_of(spec_from_dict(read_manifest(resolve_checkpoint(checkpoint)).model_spec))
    manifest, spec, state = consolidated_weights(checkpoint)
    report = export_hf(state, spec, out, max_shard_size)
    console.print(f"wrote the weights of step {manifest.step} ({spec.name}) as a Hugging Face {report.arch} model "
                  f"({report.shards} shards, {format_bytes(report.total_bytes)}) to {out}")


@app.command("inspect")
@user_errors
def inspect(
    checkpoint: Path = typer.Argument(..., help="A --checkpoint-dir (its newest checkpoint) or one step-N directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Show a training checkpoint: step, data cursor, model, the plan that wrote it, size on disk."""
    from ethpipe.runtime.ckpt_state import checkpoint_summary

    info = checkpoint_summary(checkpoint)
    if as_json:
        console.print_json(json.dumps(info))
        return
    head = Table(title=f"checkpoint {info['path']}", show_header=False)
    head.add_row("step", str(info["step"]))
    order = f"shuffled, seed {info['seed']}" if info["shuffle"] else "in order"
    head.add_row("data cursor", f"next sample {info['next_sample']} ({order})")
    head.add_row("model", f"{info['model']} ({info['num_params']:,} parameters)")
    head.add_row("plan", f"{info['plan_method']}: {len(info['pipelines'])} pipelines, world size {info['world_size']}, "
                         f"global batch {info['global_batch_size']} x seq {info['seq_len']}")
    head.add_row("size on disk", f"{format_bytes(info['size_bytes'])} in {info['num_files']} files")
    head.add_row("saved", f"{info['saved_at']} (torch {info['torch_version']})")
    head.add_row("checkpoints here", ", ".join(str(s) for s in info["checkpoints"]))
    if info["settings"]:
        head.add_row("settings", ", ".join(f"{k} {v}" for k, v in info["settings"].items()))
    if info["shard_optimizer"]:
        head.add_row("optimizer", "AdamW state sharded across pipelines (saved whole, loads under any plan)")
    console.print(head)
    pipes = Table(title="plan that wrote it")
    for column in ("pipeline", "depth", "devices", "layers per stage", "micro-batches"):
        pipes.add_column(column)
    for p_idx, pipe in enumerate(info["pipelines"]):
        layers = " | ".join(f"{lo}-{hi}" for lo, hi in pipe["layers"])
        pipes.add_row(str(p_idx), str(pipe["depth"]), ", ".join(pipe["devices"]), layers,
                      " ".join(str(b) for b in pipe["micro_batch_sizes"]))
    console.print(pipes)
