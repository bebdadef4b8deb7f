"""Imports every command module so each registers itself on the app."""

from ethpipe.cli import plan_cmds  # noqa: F401
