"""The ``ethpipe`` command line. Each command family lives in its own module and registers
itself on the shared typer app; user errors become one line on stderr and exit code 2."""

from __future__ import annotations

import sys

from ethpipe.cli.app import app


def main() -> None:
    from ethpipe.cli import commands  # noqa: F401  (registers every command on the app)

    app(prog_name="ethpipe")


if __name__ == "__main__":
    main()
    sys.exit(0)
