"""`ethpipe export` (checkpoint -> one consolidated state-dict file or a Hugging Face directory), `ethpipe inspect`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ethpipe.plan import Plan
from ethpipe.units import index_ranges
from ethpipe.plan_text import micro_batches_text, pipeline_groups, pipeline_text
from ethpipe.cli.app import app, console, user_errors
from ethpipe.units import format_bytes


def _recorded_source(checkpoint: Path) -> Optional[Path]:
    """The run's --init-from where it was a Hugging Face directory, from the run.toml beside its checkpoints."""
    import tomllib

    from ethpipe.runtime.start.run_settings import RUN_CONFIG_NAME

    for folder in (checkpoint, checkpoint.parent):
        path = folder / RUN_CONFIG_NAME
        if path.is_file():
            try:
                init = tomllib.loads(path.read_text()).get("init-from")
            except tomllib.TOMLDecodeError:
                console.print(f"{path} is not valid TOML: no source model taken from it", highlight=False)
                return None
            if init and (Path(init) / "config.json").is_file():
                console.print(f"source model: {init} (the run's --init-from, from {path})", highlight=False)
                return Path(init)
            return None
    return None


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
    dtype: Optional[str] = typer.Option(None, "--dtype", help="With --format hf: bf16, fp16 or fp32 weights (and "
                                        "config.json's dtype). Default: the precision the run trained in if the "
                                        "checkpoint records it and it is bf16 or fp16, else fp32."),
    source: Optional[Path] = typer.Option(None, "--source", help="With --format hf: the Hugging Face directory "
                                          "the run started from (its --init-from); its bos/eos/pad token ids and "
                                          "generation_config.json are carried over."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="With --format hf: copy this directory's "
                                             "tokenizer files (tokenizer.json, tokenizer_config.json, "
                                             "special_tokens_map.json, tokenizer.model, vocab/merges)."),
) -> None:
    """Write the checkpoint's model weights: as one state dict with global names (loads with
    `ethpipe train --init-from` and into `ethpipe.build_model(...)` via load_state_dict), or as a
    Hugging Face directory (config.json, sharded safetensors, index; with --source the generation
    config, with --tokenizer the tokenizer) for `transformers.AutoModelForCausalLM.from_pretrained`."""
    from ethpipe.errors import UserError
    from ethpipe.runtime.checkpoint.weights import consolidated_weights, export_checkpoint

    if fmt not in ("ethpipe", "hf"):
        raise UserError(f"--format must be ethpipe or hf, got {fmt!r}")
    if fmt == "ethpipe":
        given = [name for name, value in (("--dtype", dtype), ("--source", source), ("--tokenizer", tokenizer))
                 if value is not None]
        if given:
            raise UserError(f"{', '.join(given)} apply to --format hf only: the ethpipe format keeps the "
                            "checkpoint's weights as they are")
        manifest = export_checkpoint(checkpoint, out)
        console.print(f"wrote the weights of step {manifest.step} ({manifest.model_spec['name']}) to {out}")
        return
    from ethpipe.hf.config import hf_architecture_of
    from ethpipe.hf.export import check_out_dir, export_hf, parse_size
    from ethpipe.hf.publish import export_dtype, read_source, tokenizer_files, trained_dtype
    from ethpipe.model_spec import spec_from_dict
    from ethpipe.runtime.checkpoint.layout import read_manifest, resolve_checkpoint

    export_dtype(dtype, None)  # every cheap check before the weights are read
    parse_size(max_shard_size)
    check_out_dir(out)
    if tokenizer is not None:
        tokenizer_files(tokenizer)
    manifest = read_manifest(resolve_checkpoint(checkpoint))
    spec = spec_from_dict(manifest.model_spec)
    hf_architecture_of(spec)
    if source is None:
        source = _recorded_source(checkpoint)
    if source is not None:
        read_source(source, spec)
    weights_dtype = export_dtype(dtype, trained_dtype(manifest.extra))
    manifest, spec, state = consolidated_weights(checkpoint)
    report = export_hf(state, spec, out, max_shard_size, weights_dtype, source, tokenizer)
    console.print(f"wrote the weights of step {manifest.step} ({spec.name}) as a Hugging Face {report.arch} model "
                  f"in {report.dtype} ({report.shards} shards, {format_bytes(report.total_bytes)}) to {out}")
    if report.source is None:
        console.print("no source model given: bos/eos token ids are null and there is no generation_config.json; "
                      "pass --source HF_DIR (the run's --init-from) to carry them", highlight=False)
    else:
        ids = ", ".join(f"{k.removesuffix('_token_id')} {v}" for k, v in report.source.token_ids.items())
        how = "copied" if report.source.copied_generation_config else "built from the token ids"
        console.print(f"token ids ({ids}) from {report.source.path}; generation_config.json {how}", highlight=False)
    if report.tokenizer_files:
        console.print(f"copied {', '.join(report.tokenizer_files)} from {tokenizer}", highlight=False)


@app.command("inspect")
@user_errors
def inspect(
    checkpoint: Path = typer.Argument(..., help="A --checkpoint-dir (its newest checkpoint) or one step-N directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Show a training checkpoint: step, data cursor, model, the plan that wrote it, size on disk."""
    from ethpipe.runtime.checkpoint.state import checkpoint_summary

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
    pipes = Table(title="plan that wrote it",
                  caption="stage: device[ tpT] Lfirst-last layer (* = recompute; 7a / 7m: layer 7's attention / MLP half)")
    for column in ("pipelines", "stages", "samples each", "micro-batches"):
        pipes.add_column(column)
    for indices, pipe in pipeline_groups(Plan.from_dict(info["plan"]).pipelines):
        pipes.add_row(index_ranges(indices), pipeline_text(pipe), str(pipe.num_samples), micro_batches_text(pipe))
    console.print(pipes)
