"""`--config FILE.toml` for `plan` and `train`: a file of the command's own options (one schema, no second parser).

The keys are the command's long option names without the dashes (``global-batch``; ``global_batch`` is read
alike), the values what the option takes (a flag is ``true`` / ``false``; a repeatable option a list). The file
becomes click's ``default_map``, so click parses and checks every value exactly as it parses the command line,
and the command line overrides the file. ``write_config`` writes the options a run used in the same format, so
``train --config CHECKPOINT_DIR/run.toml`` repeats the run.

**One job file for every command.** A file of sections (``[cluster]``, ``[model]``, ``[plan]``, ``[train]``,
``[checkpoint]``, ``[metrics]``, ``[validation]``, ``[launch]``) is read by ``plan``, ``train`` and ``launch``
alike: each takes the sections it uses (``READS``) and leaves the others to the other commands. A section's keys
are the option names, or the option without the section's prefix (``[checkpoint] dir`` is ``--checkpoint-dir``,
``[metrics] file`` is ``--metrics``, ``[cluster] file`` is ``--cluster``, ``[model] name`` is ``--model``); the
``[plan]`` section's ``out`` is where ``plan`` writes the plan and what ``train`` and ``launch`` run. Relative
paths in a job file are relative to the file (a node's shell starts elsewhere). An unknown section, or an unknown
key in a section the command reads, is one line naming the nearest valid one.
"""

from __future__ import annotations

import difflib
import tomllib
import typing
from pathlib import Path
from typing import Any

import typer


def _options(command: Any) -> list[Any]:
    """The command's options (typer vendors its own click: no isinstance on click's classes), --config aside."""
    return [p for p in command.params if getattr(p, "param_type_name", "") == "option" and "--config" not in p.opts]


def _keys(command: Any) -> dict[str, Any]:
    """Every accepted key of ``command``'s file -> its option (long names with dashes and underscores)."""
    keys: dict[str, Any] = {}
    for param in _options(command):
        for opt in (*param.opts, *param.secondary_opts):
            if opt.startswith("--"):
                keys[opt[2:]] = param
                keys[opt[2:].replace("-", "_")] = param
    return keys


# The sections of a job file and which command reads each; ``RENAMES``: section keys that are not option names.
SECTIONS = ("cluster", "model", "plan", "train", "checkpoint", "metrics", "validation", "launch")
READS = {"plan": ("cluster", "model", "plan"),
         "train": ("plan", "train", "checkpoint", "metrics", "validation"),
         "launch": ("plan", "launch")}
RENAMES = {("cluster", "file"): "cluster", ("model", "name"): "model", ("model", "file"): "model",
           ("checkpoint", "dir"): "checkpoint-dir", ("metrics", "file"): "metrics", ("train", "plan"): "plan"}
PLAN_OUT = {"plan": "out", "train": "plan", "launch": "plan"}  # what [plan] out is to each command; the other
# [plan] keys are the planner's


def _takes_path(option: Any) -> bool:
    """Whether an option's value is a file or directory (``Path``, ``Optional[Path]``)."""
    annotation = getattr(getattr(option, "type_descriptor", None), "annotation", None)
    if annotation is None:  # click's own options
        return getattr(getattr(option, "type", None), "name", "") == "path"
    return annotation is Path or Path in typing.get_args(annotation)


def job_checkpoint_dir(path: Path) -> str | None:
    """A job file's ``[checkpoint] dir`` (None: none, or a flat file)."""
    section = tomllib.loads(path.read_text()).get("checkpoint")
    return section.get("dir") if isinstance(section, dict) else None


def _job_entries(command: str, sections: dict[str, Any], keys: dict[str, Any], path: Path) -> dict[str, Any]:
    """The flat ``option -> value`` a job file's sections give ``command``; relative paths resolved from ``path``."""
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        near = difflib.get_close_matches(unknown[0], SECTIONS, n=1)
        hint = f"did you mean [{near[0]}]?" if near else f"sections are {', '.join(SECTIONS)}"
        raise typer.BadParameter(f"{path}: unknown section [{unknown[0]}]: {hint}")
    out: dict[str, Any] = {}
    for section in READS.get(command, ()):
        for key, item in (sections.get(section) or {}).items():
            name = key.replace("_", "-")
            if section == "plan" and command != "plan":
                if name != "out":
                    continue  # the planner's options
                name = PLAN_OUT[command]
            else:
                name = RENAMES.get((section, name), name)
                if name not in keys and f"{section}-{name}" in keys:
                    name = f"{section}-{name}"
            option = keys.get(name)
            if option is None:
                near = difflib.get_close_matches(name, [k for k in keys if "_" not in k], n=1)
                hint = f"did you mean '{near[0]}'?" if near else f"keys are `ethpipe {command}`'s options"
                raise typer.BadParameter(f"{path}: unknown key '{key}' in [{section}]: {hint}")
            if _takes_path(option) and isinstance(item, str) and not Path(item).is_absolute():
                item = str((path.parent / item).resolve())
            out[name] = item
    return out


def _load(ctx: typer.Context, param: typer.CallbackParam, value: Path | None) -> Path | None:
    """Eager callback: read the file into ``ctx.default_map`` before any other option is parsed."""
    if value is None:
        return None
    try:
        table = tomllib.loads(value.read_text())
    except OSError as err:
        raise typer.BadParameter(f"cannot read {value}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise typer.BadParameter(f"{value} is not valid TOML: {err}") from None
    keys = _keys(ctx.command)
    sections = {k: v for k, v in table.items() if isinstance(v, dict)}
    if sections:
        flat = {k: v for k, v in table.items() if not isinstance(v, dict)}
        table = {**flat, **_job_entries(str(ctx.info_name), sections, keys, value)}
    defaults: dict[str, Any] = {}
    for key, item in table.items():
        option = keys.get(key)
        if option is None:  # click adds "(see `... --help`)" itself: the hint says the rest once
            near = difflib.get_close_matches(key, list(keys), n=1)
            hint = f"did you mean '{near[0]}'?" if near else "keys are the command's options without the dashes"
            raise typer.BadParameter(f"{value}: unknown key '{key}': {hint}")
        if option.secondary_opts and f"--{key.replace('_', '-')}" in option.secondary_opts:
            item = not item  # `no-tf32 = true` means tf32 = false
        defaults[option.name] = item  # type: ignore[index]
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def config_option(annotated: bool = False) -> Any:
    """The ``--config`` option every command that takes a file declares (``annotated``: for ``Annotated[...]``,
    where the default is the parameter's own)."""
    decls = ("--config",) if annotated else (None, "--config")
    return typer.Option(*decls, is_eager=True, callback=_load,
                        help="TOML file of this command's options (keys: the option names without dashes); "
                             "options on the command line override it.")


def _toml_value(value: Any) -> Any:
    if isinstance(value, Path):  # absolute: the file is read from wherever the run is repeated
        return str(value.resolve())
    if isinstance(value, (list, tuple)):
        return [_toml_value(v) for v in value]
    return value


def options_used(ctx: typer.Context) -> dict[str, Any]:
    """The options this invocation ran with (file, command line and defaults merged), keyed as the file is."""
    out: dict[str, Any] = {}
    for param in _options(ctx.command):
        value = ctx.params.get(param.name)  # type: ignore[arg-type]
        if value is None or (isinstance(value, (list, tuple)) and not value):
            continue
        long = next(o for o in param.opts if o.startswith("--"))[2:]
        out[long] = _toml_value(value)
    return out


def config_text(ctx: typer.Context) -> str:
    """The options this invocation ran with, as a ``--config`` file."""
    import tomli_w

    header = (f"# the options of an `ethpipe {ctx.info_name}` run: `ethpipe {ctx.info_name} --config FILE` repeats it "
              "(options given on the command line override these)\n")
    return header + tomli_w.dumps(options_used(ctx))



def from_config_file(ctx: typer.Context, name: str) -> bool:
    """Whether parameter ``name`` took its value from the --config file (not the command line, not a default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "DEFAULT_MAP"
