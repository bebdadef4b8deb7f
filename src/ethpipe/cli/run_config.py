"""`--config FILE.toml` for `plan` and `train`: a file of the command's own options (one schema, no second parser).

The keys are the command's long option names without the dashes (``global-batch``; ``global_batch`` is read
alike), the values what the option takes (a flag is ``true`` / ``false``; a repeatable option a list). The file
becomes click's ``default_map``, so click parses and checks every value exactly as it parses the command line,
and the command line overrides the file. ``write_config`` writes the options a run used in the same format, so
``train --config CHECKPOINT_DIR/run.toml`` repeats the run.
"""

from __future__ import annotations

import difflib
import tomllib
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
