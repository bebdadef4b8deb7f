"""`ethpipe export` (checkpoint -> one consolidated state-dict file) and `ethpipe inspect`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from ethpipe.cli.app import app, console, user_errors


def _human_bytes(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


@app.command("export")
@user_errors
def export(
    checkpoint: Path = typer.Argument(..., help="A --checkpoint-dir (its newest checkpoint) or one step-N directory."),
    out: Path = typer.Option(..., "--out", help="Output file: .safetensors, else torch.save format."),
) -> None:
    """Write the checkpoint's model weights as one state dict with global names: loads with
    `ethpipe train --init-from` and into `ethpipe.build_model(...)` via load_state_dict."""
    from ethpipe.runtime.ckpt_state import export_checkpoint

    manifest = export_checkpoint(checkpoint, out)
    console.print(f"wrote the weights of step {manifest.step} ({manifest.model_spec['name']}) to {out}")


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
    head.add_row("size on disk", f"{_human_bytes(info['size_bytes'])} in {info['num_files']} files")
    head.add_row("saved", f"{info['saved_at']} (torch {info['torch_version']})")
    head.add_row("checkpoints here", ", ".join(str(s) for s in info["checkpoints"]))
    console.print(head)
    pipes = Table(title="plan that wrote it")
    for column in ("pipeline", "depth", "devices", "layers per stage", "micro-batches"):
        pipes.add_column(column)
    for p_idx, pipe in enumerate(info["pipelines"]):
        layers = " | ".join(f"{lo}-{hi}" for lo, hi in pipe["layers"])
        pipes.add_row(str(p_idx), str(pipe["depth"]), ", ".join(pipe["devices"]), layers,
                      " ".join(str(b) for b in pipe["micro_batch_sizes"]))
    console.print(pipes)
