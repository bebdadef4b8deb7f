"""Imports every command module so each registers itself on the app."""

from ethpipe.cli import calibrate_cmds  # noqa: F401
from ethpipe.cli import ckpt_cmds  # noqa: F401
from ethpipe.cli import cluster_cmds  # noqa: F401
from ethpipe.cli import demo_cmd  # noqa: F401
from ethpipe.cli import launch_cmds  # noqa: F401
from ethpipe.cli import plan_cmds  # noqa: F401
from ethpipe.cli import replan_cmds  # noqa: F401
from ethpipe.cli import sim_cmds  # noqa: F401
from ethpipe.cli import train_cmds  # noqa: F401
