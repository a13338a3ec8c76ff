"""Lowers the OS priority of a node's throughput threads so that its latency-critical ones get the CPU at once.

A node's threads share its CPUs: on a prefill node the prompt's compute, the head start's decode steps and the
speculative pushes run beside the threads that answer a decode step's fetches; on a decode node the landing of
pushes runs beside the decode step. A fetch's round trip crosses several thread wake-ups, and on a busy core each
waited for the compute thread's time slice (measured on this project's 2-core machine, random:32 at 2K in a burst of
two: the prefill node's receive and serve wake-ups 0.55 and 0.44 ms on average, 1.5 and 1.3 ms at p90; with its
compute threads at nice 10, 0.36 and 0.20, p90 0.54 and 0.25). Raising a thread's priority needs privileges;
lowering one's own never does.

`SMARTGEN_BACKGROUND_NICE` sets the niceness given (default 10; 0 leaves every thread as it is). Linux only: there a
thread is its own schedulable task, where elsewhere `setpriority` would lower the whole process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["BACKGROUND_NICE", "background_nice", "lower_this_thread"]

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10
ENV = "SMARTGEN_BACKGROUND_NICE"
_warned: set[str] = set()


def background_nice() -> int:
    """The niceness throughput threads take: $SMARTGEN_BACKGROUND_NICE (0-19), else BACKGROUND_NICE."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return BACKGROUND_NICE
    try:
        value = int(raw)
    except ValueError:
        if raw not in _warned:  # every lowered thread asks: say it once
            _warned.add(raw)
            log.warning("%s=%r is not an integer: using %d", ENV, raw, BACKGROUND_NICE)
        return BACKGROUND_NICE
    return min(max(value, 0), 19)


def lower_this_thread(nice: int | None = None) -> bool:
    """Gives the calling thread `nice` (default: `background_nice()`) more niceness than it has; True when it did.

    Never raises: a platform without per-thread priorities, or a sandbox that refuses, leaves the thread as it was.
    """
    step = background_nice() if nice is None else nice
    if step <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + step, 19))
    except OSError as exc:
        log.debug("could not lower thread %s's priority: %s", threading.current_thread().name, exc)
        return False
    return True
