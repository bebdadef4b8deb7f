"""The ``ethpipe`` command line. Each command family lives in its own module and registers
itself on the shared typer app; user errors become one line on stderr and exit code 2."""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from ethpipe.cli.app import app, err_console


def main() -> None:
    """Run the app; click usage errors (bad option, wrong type) become one line too."""
    from ethpipe.cli import commands  # noqa: F401  (registers every command on the app)

    try:
        result = app(prog_name="ethpipe", standalone_mode=False)
    except typer.TyperException as err:  # usage errors: unknown option, wrong type, missing value
        if not err.format_message():  # bare `ethpipe`: the help was already shown
            sys.exit(2)
        ctx = getattr(err, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        message = escape(f"{err.format_message()}{hint}")  # text, not markup: `[train]` in it stays
        err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
        sys.exit(2 if err.exit_code == 2 else 1)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
