"""The shared typer app and the error policy every command follows."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console

app = typer.Typer(
    name="ethpipe",
    help="Data-balanced heterogeneous pipeline parallelism (ETH): plan, simulate, train, compare.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(func: F) -> F:
    """Turn ValueError (our user-error type) into one line on stderr and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ValueError as err:
            message = str(err).splitlines()[0] if str(err) else type(err).__name__
            err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


@app.callback()
def _root() -> None:
    """Data-balanced heterogeneous pipeline parallelism (ETH): plan, simulate, train, compare."""
