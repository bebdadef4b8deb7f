"""Per-step timing of one rank without holding the host: events on the GPU, the wall clock on CPU.

On a GPU the host runs ahead of the device, so host timestamps say nothing about when kernels ran.
``Timeline`` records a CUDA event at each mark and reads them all once per step, after the step's one
host synchronisation (the stats read), when every event has completed. On CPU, or where the emulator
paces actions on the host (``synchronous``), a mark is the wall clock (after a device synchronisation
on an accelerator, so that the host time means something).

What the marks measure: ``busy_s`` is the sum of the forward/backward actions' durations (``fwd_s`` and
``bwd_s`` its two parts: what `ethpipe calibrate --from-run` fits the device types to), ``phase_s``
the time from the step's first action to the end of its last backward (data loading before it left
out), ``sync_exposed_s`` the time from the end of the step's last sends (the final p2p batch) until the
gradient sync has completed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ethpipe.schedule import is_action_name

Mark = float | torch.cuda.Event


def _sync_device(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@dataclass
class Timeline:
    """One rank's marks for the current step, resolved by ``finish_step``; trace events if ``record``."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    synchronous: bool = True  # marks on the wall clock (CPU, or actions paced on the host)
    record: bool = False
    events: list[tuple[str, float, float]] = field(default_factory=list)  # (name, start_s, end_s): traces
    busy_s: float = 0.0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    phase_s: float = 0.0
    sync_exposed_s: float = 0.0
    _spans: list[tuple[str, Mark, Mark]] = field(default_factory=list)
    _start: Mark = 0.0
    _start_wall_s: float = 0.0
    _phase_end: Mark | None = None
    _sends_done: Mark | None = None
    _sync_done: Mark | None = None

    @property
    def uses_events(self) -> bool:
        return self.device.type == "cuda" and not self.synchronous

    def mark(self) -> Mark:
        if self.uses_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        _sync_device(self.device)
        return time.time()

    def _seconds(self, a: Mark, b: Mark) -> float:
        if isinstance(a, float):
            return float(b) - a  # type: ignore[arg-type]
        return a.elapsed_time(b) / 1e3  # type: ignore[arg-type]

    def start_step(self) -> None:
        self._spans.clear()
        self._phase_end = self._sends_done = self._sync_done = None
        self._start_wall_s = time.time()
        self._start = self.mark()

    def span(self, name: str, start: Mark, end: Mark) -> None:
        """A forward/backward action (counted as busy) or, with a name like 'allreduce ...', another slice."""
        self._spans.append((name, start, end))

    def end_phase(self) -> None:
        """The last backward has ended."""
        self._phase_end = self.mark()

    def sends_done(self) -> None:
        """The step's last p2p batch (the last backward's sends) is waited: the sync's wait starts here."""
        self._sends_done = self.mark()

    def sync_done(self) -> None:
        self._sync_done = self.mark()

    def finish_step(self) -> None:
        """Resolve this step's marks (every event has completed: call after the step's host synchronisation)."""
        offset = self._start_wall_s
        fwd = bwd = 0.0
        for name, a, b in self._spans:
            duration = self._seconds(a, b)
            if is_action_name(name):  # F3, B3, W3; an interleaved chunk's F3.1
                if name[0] == "F":
                    fwd += duration
                else:
                    bwd += duration
            if self.record:
                start = offset + self._seconds(self._start, a)
                self.events.append((name, start, start + duration))
        self.fwd_s, self.bwd_s = fwd, bwd
        self.busy_s = fwd + bwd
        self.phase_s = self._seconds(self._start, self._phase_end) if self._phase_end is not None else 0.0
        self.sync_exposed_s = (self._seconds(self._sends_done, self._sync_done)
                               if self._sends_done is not None and self._sync_done is not None else 0.0)

    def add(self, name: str, start_s: float, end_s: float) -> None:
        """A host-timed slice (optimizer step, checkpoint save) for the trace."""
        if self.record:
            self.events.append((name, start_s, end_s))
