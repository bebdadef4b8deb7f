"""`ethpipe train` (local spawn or one torchrun rank) and `ethpipe data prepare`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape

from ethpipe.cli.app import app, console, err_console, user_errors
from ethpipe.cli.run_config import config_option, config_text, from_config_file
from ethpipe.errors import UserError
from ethpipe.precision import canonical_dtype
from ethpipe.cli.learn import DEFAULT_MIN_GAIN
from ethpipe.comm.program import DEFAULT_BUCKET_BYTES

data_app = typer.Typer(help="Make token files for `ethpipe train`.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@app.command()
@user_errors
def train(
    ctx: typer.Context,
    config_file: Optional[Path] = config_option(),
    plan: Path = typer.Option(..., "--plan", help="Plan JSON (from `ethpipe plan` or hand-written)."),
    data: Path = typer.Option(..., "--data", help="Token file (.bin, uint16/uint32, nanoGPT layout)."),
    steps: int = typer.Option(..., "--steps", help="Optimizer steps; step k uses global samples [k*B, (k+1)*B)."),
    lr: float = typer.Option(3e-4, "--lr", help="Peak learning rate (AdamW, betas 0.9/0.95, eps 1e-8)."),
    weight_decay: float = typer.Option(0.1, "--weight-decay", help="Decoupled, on >=2-D parameters only."),
    clip_grad: float = typer.Option(0.0, "--clip-grad", help="Max global gradient norm; 0 disables clipping."),
    seed: int = typer.Option(0, "--seed", help="Seed of the model init and of --shuffle."),
    shuffle: bool = typer.Option(False, "--shuffle", help="Visit samples in a seeded random permutation."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", callback=canonical_dtype, help="Default: the plan's precision (what its memory was checked for; fp32 if it records "
                              "none). fp32; bf16 or fp16 (autocast over fp32 weights and optimizer; fp16 with "
                              "dynamic loss scaling); or fp64 (weights, activations and optimizer in float64: "
                              "verifies exactness, ~2x slower). Another precision than the plan's is re-checked "
                              "for memory."),
    recompute: bool = typer.Option(False, "--recompute", help="Recompute activations in backward (all stages)."),
    metrics: Optional[Path] = typer.Option(None, "--metrics", help="Write one JSON line per step here."),
    init_from: Optional[Path] = typer.Option(
        None, "--init-from", help="Start from a consolidated state dict, or a Hugging Face model directory "
                                  "(config.json + *.safetensors; each rank reads only its tensors)."),
    save_final: Optional[Path] = typer.Option(None, "--save-final", help="Write the trained consolidated weights."),
    emulate: bool = typer.Option(False, "--emulate", help="Slow each rank to its device type's relative speed."),
    emulate_mode: str = typer.Option(
        "paced", "--emulate-mode", help="With --emulate: paced (the plan's emulation.compute_s targets, else as "
                                        "measured) or measured (each action's real compute x time_scale / speed)."),
    warmup_steps: int = typer.Option(0, "--warmup-steps", help="Linear LR warm-up steps (default: none)."),
    lr_schedule: str = typer.Option("constant", "--lr-schedule", help="constant (default), cosine, linear (both down "
                                    "to --min-lr-ratio at the last step) or wsd (warmup-stable-decay: constant, then "
                                    "linear down over the last --decay-fraction of the steps)."),
    min_lr_ratio: float = typer.Option(0.1, "--min-lr-ratio", help="cosine / linear / wsd: the last step's lr as a "
                                       "share of --lr."),
    decay_fraction: float = typer.Option(0.2, "--decay-fraction", help="wsd: the share of the steps after warm-up "
                                         "spent decaying."),
    adam_beta1: float = typer.Option(0.9, "--adam-beta1", help="AdamW beta1."),
    adam_beta2: float = typer.Option(0.95, "--adam-beta2", help="AdamW beta2."),
    adam_eps: float = typer.Option(1e-8, "--adam-eps", help="AdamW epsilon."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write a Chrome/Perfetto trace of F/B/all-reduce."),
    device: str = typer.Option("auto", "--device", help="auto (accelerator if present), cuda (refuse to run "
                               "without one) or cpu."),
    timeout_s: float = typer.Option(300.0, "--timeout-s", help="Fail any collective that waits longer."),
    start_timeout_s: float = typer.Option(
        1800.0, "--start-timeout-s", help="Wait this long for the slowest rank to build and load its stage."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar (and no console lines)."),
    log_every: int = typer.Option(0, "--log-every", help="A console line (step, loss, tokens/s, measured vs "
                                  "predicted step time, loss scale) every N steps; 0: every 10 s when the output is "
                                  "not a terminal (SLURM logs, | tee), else the progress bar only."),
    tensorboard: Optional[Path] = typer.Option(None, "--tensorboard", help="Write TensorBoard event files here "
                                               "(needs the tensorboard package: pip install 'ethpipe\\[tensorboard]')."),
    wandb: Optional[str] = typer.Option(None, "--wandb", help="Log to this Weights & Biases project, offline (a run "
                                        "directory for `wandb sync`) unless WANDB_MODE is set; needs ethpipe\\[wandb]."),
    checkpoint_dir: Optional[Path] = typer.Option(
        None, "--checkpoint-dir", help="Save training checkpoints here (plan-independent; see `ethpipe inspect`)."),
    save_every: int = typer.Option(0, "--save-every", help="Checkpoint every K steps (0: only after the last)."),
    keep: int = typer.Option(3, "--keep", help="Keep the newest N checkpoints."),
    resume: bool = typer.Option(False, "--resume",
                                help="Continue from the newest complete checkpoint in --checkpoint-dir, "
                                     "under this plan (any shape) with the same sample stream."),
    strict_resume: bool = typer.Option(False, "--strict-resume",
                                       help="Refuse a resume that changes a setting the checkpoint recorded (lr, "
                                            "schedule, warm-up, weight decay, clipping, seed, shuffle, dtype, "
                                            "data file); without it each change is printed old -> new."),
    auto_resume: bool = typer.Option(False, "--auto-resume",
                                     help="Resume if --checkpoint-dir holds a complete checkpoint, else start fresh "
                                          "(for torchrun --max-restarts: every attempt runs the same command)."),
    replan_cluster: Optional[Path] = typer.Option(
        None, "--replan-cluster", help="Cluster of the job: when the world differs from the plan's (a rank was lost "
                                       "or added), re-plan for the world's devices (the first WORLD_SIZE of it)."),
    rebalance: Optional[str] = typer.Option(
        None, "--rebalance", help="Online data rebalancing: every=K[,threshold=0.05][,window=K] (measured rates, "
                                  "same global batch, no weights moved)."),
    emulate_slowdown: Optional[list[str]] = typer.Option(
        None, "--emulate-slowdown", help="With --emulate: RANK:FACTOR@STEP makes a rank FACTOR times slower from "
                                         "STEP on (repeatable)."),
    watchdog_s: Optional[float] = typer.Option(
        None, "--watchdog-s", help="End a rank without progress for this long (default 2 x --timeout-s + 60; 0: off)."),
    log_sample_ids: bool = typer.Option(False, "--log-sample-ids", help="List each step's sample ids in --metrics."),
    samples: str = typer.Option("packed", "--samples", help="packed (default: sample i is the stream's tokens "
                                "[i*s, (i+1)*s], across documents) or documents (every sample inside one document, "
                                "padded; the loss the mean over the counted tokens of the global batch)."),
    val_data: Optional[Path] = typer.Option(None, "--val-data", help="Held-out token file for the validation "
                                            "loss (`ethpipe data prepare --val-fraction` writes one)."),
    eval_every: int = typer.Option(0, "--eval-every", min=0, help="The validation loss every N steps and after the "
                                   "last (console, --metrics val_loss, TensorBoard val/loss); 0: never."),
    eval_batches: int = typer.Option(4, "--eval-batches", min=1, help="Global batches of --val-data per evaluation "
                                     "(the same ones each time)."),
    fp32_residual: bool = typer.Option(False, "--fp32-residual", help="16-bit runs: keep the residual stream in "
                                       "fp32 (default: bf16/fp16, as Megatron; more activation memory than planned)."),
    compile_blocks: bool = typer.Option(False, "--compile", help="torch.compile each decoder block (the first "
                                        "steps pay the compilation; not with tensor-parallel stages)."),
    bucket_mib: float = typer.Option(DEFAULT_BUCKET_BYTES / 2**20, "--bucket-mib", help="Gradient-sync bucket size "
                                     "in MiB (0: one all-reduce per sync unit: a block, or its slice under mixed TP)."),
    replan_after: int = typer.Option(
        0, "--replan-after", help="After N steps: fit the device types' measured compute, re-plan on the same "
                                  "devices, and switch (checkpoint, reload, continue) if the new plan is predicted "
                                  "faster by --replan-min-gain; needs --checkpoint-dir (0: never)."),
    replan_min_gain: float = typer.Option(
        DEFAULT_MIN_GAIN, "--replan-min-gain", help="Least predicted gain (fraction of the step time) that makes "
                                                    "--replan-after switch plans."),
    no_overlap_grad_sync: bool = typer.Option(
        False, "--no-overlap-grad-sync", help="Start the gradient all-reduces after the last backward's sends "
                                              "instead of from its hooks (for NCCL setups that serialise "
                                              "communicators; docs/runtime.md, \"On GPUs\")."),
) -> None:
    """Train with a plan, exactly: loss = mean token cross-entropy over the whole global batch,
    no dropout. Without torchrun the plan's world is spawned on this machine; under
    `torchrun --nproc-per-node N -m ethpipe train ...` this process is one rank."""
    from ethpipe.plan import Plan
    from ethpipe.runtime.adapt.emulate import parse_slowdown
    from ethpipe.runtime.start.launch import TrainingFailed, in_torchrun, run_local, run_torchrun
    from ethpipe.runtime.adapt.rebalance import parse_rebalance
    from ethpipe.runtime.train import TrainConfig

    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device must be auto, cuda or cpu, got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: this machine has no CUDA device; train where the GPUs are, or use "
                            "--device cpu")
        device = "auto"  # the accelerator, one per local rank
    slowdowns = tuple(parse_slowdown(text) for text in emulate_slowdown or [])
    if slowdowns and not emulate:
        raise UserError("--emulate-slowdown needs --emulate (it slows an emulated device)")
    if emulate_mode != "paced" and not emulate:
        raise UserError("--emulate-mode needs --emulate (it chooses how an emulated device is paced)")
    balance = parse_rebalance(rebalance) if rebalance is not None else None
    the_plan = Plan.load(plan)
    if (resume or auto_resume) and init_from is not None and from_config_file(ctx, "init_from"):
        init_from = None  # a repeated run's --init-from (run.toml): a resumed run takes its weights from the checkpoint
    if replan_cluster is not None:
        from ethpipe.cli.replanning import plan_for_world

        world = int(os.environ["WORLD_SIZE"]) if in_torchrun() else the_plan.world_size
        the_plan = plan_for_world(the_plan, replan_cluster, world)
        if os.environ.get("RANK", "0") == "0":  # the new plan, said once (every rank planned alike)
            predicted = (the_plan.predicted or {}).get("iteration_time_s")
            console.print(f"--replan-cluster: planned for {the_plan.world_size} ranks: {len(the_plan.pipelines)} "
                          f"pipelines of depths {sorted({p.depth for p in the_plan.pipelines})}"
                          + (f", predicted {predicted:.3f} s/step" if predicted else ""), highlight=False)
    config = TrainConfig(
        data=str(data), steps=steps, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, seed=seed,
        shuffle=shuffle, dtype=dtype, recompute=recompute,  # type: ignore[arg-type]
        metrics=str(metrics) if metrics else None, init_from=str(init_from) if init_from else None,
        save_final=str(save_final) if save_final else None, emulate=emulate,
        emulate_mode=emulate_mode, warmup_steps=warmup_steps,  # type: ignore[arg-type]
        lr_schedule=lr_schedule, trace=str(trace) if trace else None,  # type: ignore[arg-type]
        min_lr_ratio=min_lr_ratio, decay_fraction=decay_fraction, adam_betas=(adam_beta1, adam_beta2),
        adam_eps=adam_eps,
        timeout_s=timeout_s, start_timeout_s=start_timeout_s, progress=not no_progress, device=device,  # type: ignore[arg-type]
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, save_every=save_every, keep=keep,
        resume=resume, strict_resume=strict_resume, auto_resume=auto_resume, rebalance=balance, slowdowns=slowdowns, watchdog_s=watchdog_s,
        log_sample_ids=log_sample_ids, bucket_bytes=int(bucket_mib * 2**20),
        overlap_grad_sync=not no_overlap_grad_sync, compile=compile_blocks, fp32_residual=fp32_residual,
        samples=samples,  # type: ignore[arg-type]
        val_data=str(val_data) if val_data else None, eval_every=eval_every, eval_batches=eval_batches,
        log_every=log_every, tensorboard=str(tensorboard) if tensorboard else None, wandb=wandb,
        run_config=config_text(ctx) if checkpoint_dir else None,
    )
    config = settings_of_the_checkpoint(ctx, config)
    replanner = None
    if replan_after:
        from ethpipe.runtime.adapt.replan_step import MIN_STEPS_BEFORE_REPLAN

        if not MIN_STEPS_BEFORE_REPLAN <= replan_after < steps or checkpoint_dir is None:
            raise UserError(f"--replan-after must be between {MIN_STEPS_BEFORE_REPLAN} (the first step is warm-up) and "
                            f"--steps - 1 and needs --checkpoint-dir (the switch goes through a checkpoint), got "
                            f"{replan_after}")
        from ethpipe.cli.learn import RunReplanner

        replanner = RunReplanner(replan_after, replan_min_gain, dtype=dtype, emulate=emulate)
    try:
        records = (run_torchrun(the_plan, config, replanner) if in_torchrun()
                   else run_local(the_plan, config, replanner=replanner))
    except TrainingFailed as err:  # a rank died or crashed: one line (naming the kept traceback of a crash)
        err_console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)  # not markup
        sys.exit(1)
    if records:
        last = records[-1]
        console.print(f"trained {len(records)} steps: loss {records[0]['loss']:.4f} -> {last['loss']:.4f}, "
                      f"{last['tokens_per_s']:.0f} tokens/s (last step)")


@data_app.command("prepare")
@user_errors
def prepare(
    out: Path = typer.Option(..., "--out", help="Token file to write (.bin; a .bin.json sidecar records dtype)."),
    text: Optional[list[Path]] = typer.Option(None, "--text", help="UTF-8 text file(s), one document each."),
    inputs: Optional[list[Path]] = typer.Option(
        None, "--input", help="Input file(s) by suffix: .jsonl (one JSON object a line), .parquet, else plain text."),
    field: str = typer.Option("text", "--field", help="The text field of .jsonl records / column of .parquet files."),
    builtin_text: bool = typer.Option(False, "--builtin-text",
                                      help="Use the docstrings of Python's standard library (offline, real text)."),
    tokenizer: Optional[Path] = typer.Option(
        None, "--tokenizer", help="Hugging Face tokenizer.json or a model directory holding one (needs `tokenizers`); "
                                  "documents are separated by its EOS token. Default: bytes (vocab 256)."),
    max_bytes: int = typer.Option(4_000_000, "--max-bytes", help="Cap on --builtin-text characters."),
    val_fraction: float = typer.Option(0.0, "--val-fraction", help="Move this share of the tokens (the last "
                                       "documents) into NAME.val.bin, for `train --val-data` (0: none)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    """Tokenize real text into a token file, streaming (inputs larger than memory work): byte-level
    (vocab 256, blank line between documents) unless --tokenizer is given; uint16 tokens when the
    vocabulary fits, else uint32."""
    from itertools import chain

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from ethpipe.tokens.texts import builtin_text as stdlib_docs
    from ethpipe.tokens.prepare import Doc, iter_docs, write_tokens

    files = [*(text or []), *(inputs or [])]
    if val_fraction and not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if not files and not builtin_text:
        raise UserError("give --input FILE / --text FILE (repeatable) or --builtin-text")
    for path in files:
        if not path.is_file():
            raise UserError(f"input file '{path}' not found")
    if text:
        for path in text:
            if path.suffix.lower() in (".jsonl", ".ndjson", ".parquet"):
                raise UserError(f"--text '{path}' is not plain text: pass it with --input (and --field)")
    builtin = [Doc(d, True, len(d)) for d in stdlib_docs(max_bytes)] if builtin_text else []
    docs = chain(iter_docs(files, field), builtin)
    total = sum(p.stat().st_size for p in files) + sum(d.nbytes for d in builtin)
    with Progress(TextColumn("tokenize"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console, disable=no_progress, transient=True) as bar:
        task = bar.add_task("tokenize", total=total)
        count = write_tokens(docs, out, tokenizer, progress=lambda n: bar.advance(task, n))
    if val_fraction:
        from ethpipe.tokens.split import split_validation, val_path

        kept, held = split_validation(out, val_fraction)
        console.print(f"wrote {kept} tokens to {out} and {held} held-out tokens to {val_path(out)} "
                      f"(`ethpipe train --val-data {val_path(out)} --eval-every N`)", highlight=False)
        return
    console.print(f"wrote {count} tokens to {out}")


# TrainConfig fields a resume takes from the checkpoint unless given (``run_settings.SETTINGS``; the precision stays
# the plan's, which a re-plan may have changed), and the options that give each.
RESUMED = ("lr", "lr_schedule", "warmup_steps", "min_lr_ratio", "decay_fraction", "adam_betas", "adam_eps",
           "weight_decay", "clip_grad", "seed", "shuffle", "samples")
OPTIONS_OF = {"adam_betas": ("adam_beta1", "adam_beta2")}


def settings_of_the_checkpoint(ctx: typer.Context, config: Any) -> Any:
    """A resume continues the run as it was, as torchtitan and Megatron do: every recorded setting not given on
    the command line (or by --config) comes from the checkpoint it resumes; a given one is a change, which the
    start line reports (``--strict-resume`` refuses it)."""
    import dataclasses

    from ethpipe.runtime.checkpoint.layout import complete_checkpoints, read_manifest

    if config.checkpoint_dir is None or not (config.resume or config.auto_resume):
        return config
    found = complete_checkpoints(config.checkpoint_dir)
    if not found:
        return config  # a fresh start (--auto-resume), or an error check_inputs words
    try:
        saved = read_manifest(found[-1][1]).extra.get("settings") or {}
    except UserError:
        return config
    given = {name for name in RESUMED if any(
        (source := ctx.get_parameter_source(option)) is not None and source.name in ("COMMANDLINE", "ENVIRONMENT",
                                                                                    "DEFAULT_MAP")
        for option in OPTIONS_OF.get(name, (name,)))}
    taken = {k: tuple(saved[k]) if k == "adam_betas" else saved[k] for k in RESUMED if k in saved and k not in given}
    return dataclasses.replace(config, **taken) if taken else config
