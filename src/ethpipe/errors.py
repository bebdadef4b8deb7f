"""The exception types that keep bad input apart from bugs, and the crash report that keeps a bug's traceback.

``UserError`` is the only exception the CLI prints as one line (exit 2); anything else is a bug in
ethpipe and is kept whole in a crash report file (exit 1), so it is never mistaken for bad input.
Both subclass ``ValueError`` so callers written against ``ValueError`` keep working.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

CRASH_DIR_ENV = "ETHPIPE_CRASH_DIR"


class UserError(ValueError):
    """Bad input: the message is one line naming the field (or file) and the fix."""


class ReportedElsewhere(UserError):
    """Another rank's input failed the pre-flight check and that rank prints the one line: exit 2 silently, so a
    multi-node job shows the cause once instead of once per rank (``runtime/start/preflight.py``)."""


class Infeasible(UserError):
    """The input cannot be planned or run as asked (memory does not fit, more pipelines than samples).

    Planners drop candidates that raise it and catch nothing else, so a bug in pricing a candidate
    is never mistaken for an infeasible one; when every candidate is infeasible the last reason
    reaches the user as one line.
    """


def crash_dir() -> Path:
    """Where crash reports go: ``$ETHPIPE_CRASH_DIR`` if set, else the system temp directory."""
    return Path(os.environ.get(CRASH_DIR_ENV) or tempfile.gettempdir())


def write_crash_report(text: str) -> Path:
    """Keep a traceback in ``ethpipe-crash-<time>-<pid>.txt`` (a new file each time) and return its path."""
    folder = crash_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = folder / f"ethpipe-crash-{stamp}-{os.getpid()}-{time.time_ns() % 10**9:09d}.txt"
    path.write_text(text)
    return path


def parse_error_summary(err: Exception) -> str:
    """One line for a YAML or JSON syntax error, with the line and column it is at (a broken indentation named
    nothing before: 'while parsing a block collection')."""
    mark = getattr(err, "problem_mark", None)
    if mark is not None:  # yaml.MarkedYAMLError
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context = getattr(err, "context", None)
        return f"{problem}{f' ({context})' if context else ''} at line {mark.line + 1}, column {mark.column + 1}"
    if hasattr(err, "lineno") and hasattr(err, "colno") and hasattr(err, "msg"):  # json.JSONDecodeError
        return f"{err.msg} at line {err.lineno}, column {err.colno}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__
