"""Discrete-event simulator of a Plan, its traces and timeline pictures."""

from ethpipe.sim.engine import simulate
from ethpipe.sim.report import RankStats, SimEvent, SimReport
from ethpipe.sim.timing import TimingModel

__all__ = ["RankStats", "SimEvent", "SimReport", "TimingModel", "simulate"]
