"""This process's CPU second by second, by thread role: what a node's CPUs went to over time (`/status` `cpu_timeline`).

`threads_cpu` says what a node's threads used in all; a bench round has phases (a burst's prefills, then decoding
alone) whose costs it cannot tell apart. Once a second a sampler reads `thread_cpu_seconds` and books what each
role used since the last read, in milliseconds, into a `LinkTimeline` (the same one-second bins of the monotonic
clock, the last hour), so `smartgen bench` cuts a round's seconds out of it as it does the link's. One sampler per
process (a colocated node's two halves share it); reading /proc for a few dozen threads costs about a millisecond.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from smartgen.lanes.link_timeline import LinkTimeline
from smartgen.roles.thread_cpu import thread_cpu_seconds

__all__ = ["CpuTimeline", "process_cpu_timeline"]


class CpuTimeline:
    """CPU milliseconds by thread role per `bin_s` of the monotonic clock, sampled by its own thread once started."""

    def __init__(
        self, bin_s: float = 1.0, keep_bins: int = 3600, read: Callable[[], dict[str, float]] = thread_cpu_seconds
    ) -> None:
        self.bin_s = bin_s
        self._read = read
        self._bins = LinkTimeline(bin_s, keep_bins)
        self._last: dict[str, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self, at: float | None = None) -> None:
        """Books what each role used since the last sample at `at` (now); the first sample only sets the start. A
        role whose threads ended meanwhile (a link closed) reads lower than before: it counts from there."""
        now = self._read()
        last, self._last = self._last, now
        if last is None:
            return
        at = time.monotonic() if at is None else at
        for role, seconds in now.items():
            used = round(1000 * (seconds - last.get(role, 0.0)))
            if used > 0:
                self._bins.add(at, used, role)

    def start(self) -> None:
        """Samples every `bin_s` on a daemon thread until `stop` (once; later calls do nothing)."""
        if self._thread is not None:
            return
        self.sample()
        self._thread = threading.Thread(target=self._run, name="cpu-timeline", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.bin_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def snapshot(self) -> dict[str, Any]:
        """{"bin_s": seconds a bin, "bins": [[bin start (monotonic s), {role: CPU ms}], ...]} in time order."""
        return self._bins.snapshot()


_process_timeline: CpuTimeline | None = None
_process_lock = threading.Lock()


def process_cpu_timeline() -> CpuTimeline:
    """This process's timeline, started at the first call (a node's start)."""
    global _process_timeline
    with _process_lock:
        if _process_timeline is None:
            _process_timeline = CpuTimeline()
            _process_timeline.start()
        return _process_timeline
