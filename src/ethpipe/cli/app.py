"""The shared typer app and the error policy every command follows."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from ethpipe.errors import ReportedElsewhere, UserError, write_crash_report

app = typer.Typer(
    name="ethpipe",
    help="Data-balanced heterogeneous pipeline parallelism (ETH): plan, simulate, train, compare.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped (SLURM logs, `| tee`, CI) rich would cut tables at 80 columns; there every line keeps its full width
# (COLUMNS, where set, still decides). A terminal keeps rich's own width and wrapping.
PIPED_WIDTH = 100_000


def _width(stream: Any) -> int | None:
    return None if os.environ.get("COLUMNS") or stream.isatty() else PIPED_WIDTH


console = Console(width=_width(sys.stdout))
err_console = Console(stderr=True, width=_width(sys.stderr))
HEADING_WIDTH = 100


def heading(text: str) -> None:
    """A titled rule, at most ``HEADING_WIDTH`` wide: a rule spans the console, which piped is PIPED_WIDTH."""
    from rich.rule import Rule

    console.print(Rule(text), width=min(console.width, HEADING_WIDTH))

F = TypeVar("F", bound=Callable[..., Any])


def print_error(message: str) -> None:
    """The one error line every command prints on stderr (the message verbatim: `ethpipe[hf]` or `[fwd_s, bwd_s]`
    in it are text, not markup)."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def report_crash(err: BaseException) -> str:
    """Keep the traceback of an unexpected exception (a bug, or the environment: disk, network) in a
    crash report; one line naming the exception and the file."""
    path = write_crash_report(traceback.format_exc())
    first = str(err).splitlines()[0] if str(err) else ""
    return f"crashed with {type(err).__name__}{': ' + first if first else ''} (traceback kept in {path})"


def user_errors(func: F) -> F:
    """UserError: one line on stderr, exit code 2. Any other exception (a bug, or the environment) is a
    crash: its traceback goes to a crash report in errors.crash_dir(), one line names it, exit code 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        console.width, err_console.width = _width(sys.stdout), _width(sys.stderr)  # COLUMNS may be set now
        try:
            return func(*args, **kwargs)
        except UserError as err:
            if not isinstance(err, ReportedElsewhere):
                print_error(str(err).splitlines()[0] if str(err) else type(err).__name__)
            sys.exit(2)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # typer's own control flow and usage errors
        except Exception as err:  # noqa: BLE001 - every bug gets the same crash report
            print_error(report_crash(err))
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


@app.callback()
def _root() -> None:
    """Data-balanced heterogeneous pipeline parallelism (ETH): plan, simulate, train, compare."""
