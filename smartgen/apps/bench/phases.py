"""The phases of a benchmark run, as a progress bar and results.json see them: what runs, how far, how long."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Phases", "ProgressFn"]

# progress(what, done, total): a phase's description and its steps so far; total None when the phase has no
# count to show (loading the model, profiling it), which a bar shows as a spinner beside the description
ProgressFn = Callable[[str, int, int | None], None]


@dataclass(slots=True)
class _Phase:
    name: str
    total: int | None
    done: int = 0
    started: float = 0.0
    seconds: float | None = None  # set when the phase ends


class Phases:
    """Opens one phase after another, reports every step to `progress`, and keeps each phase's steps and seconds.

    A phase opens at done = 0 with its total (so a bar can reset its ETA there); every later report of it has
    done >= 1 or repeats 0 with the same total, so a viewer can tell a new phase by a drop in done or a new total.
    """

    def __init__(self, progress: ProgressFn | None = None) -> None:
        self._progress = progress
        self._phases: list[_Phase] = []

    def start(self, name: str, total: int | None, what: str | None = None) -> None:
        """Ends the open phase and opens `name` with `total` steps (None: no count)."""
        self.end()
        self._phases.append(_Phase(name, total, started=time.monotonic()))
        self._report(what or name)

    def step(self, what: str, num_steps: int = 1) -> None:
        """`num_steps` more steps of the open phase are done; `what` describes where it is now."""
        self._phases[-1].done += num_steps
        self._report(what)

    def say(self, what: str) -> None:
        """A new description for the open phase (starting nodes, a profiling message); no step."""
        self._report(what)

    def end(self) -> None:
        """Closes the open phase, if any, recording its seconds."""
        if self._phases and self._phases[-1].seconds is None:
            self._phases[-1].seconds = time.monotonic() - self._phases[-1].started

    def to_json(self) -> list[dict[str, Any]]:
        """Per phase in order: name, steps done, their total (None: uncounted) and seconds."""
        return [{"phase": p.name, "done": p.done, "total": p.total, "seconds": p.seconds} for p in self._phases]

    def _report(self, what: str) -> None:
        if self._progress is not None and self._phases:
            phase = self._phases[-1]
            self._progress(what, phase.done, phase.total)
