"""Lowers the OS priority of a node's throughput threads so that its latency-critical ones get the CPU at once.

A node's threads share its CPUs: on a prefill node the prompt's compute, the head start's decode steps and the
speculative pushes run beside the threads that answer a decode step's fetches; on a decode node the landing of
pushes runs beside the decode step. A fetch's round trip crosses several thread wake-ups, and on a busy core each
waited for the compute thread's time slice (measured on this project's 2-core machine, random:32 at 2K in a burst of
two: the prefill node's receive and serve wake-ups 0.55 and 0.44 ms on average, 1.5 and 1.3 ms at p90; with its
compute threads at nice 10, 0.36 and 0.20, p90 0.54 and 0.25). Raising a thread's priority needs privileges;
lowering one's own never does.

Niceness sets a thread's share of a busy CPU, not whether it interrupts: a woken thread of any niceness may still
preempt the running one at once. A decode node's process therefore runs under SCHED_BATCH (`batch_this_thread`, which
the threads it starts inherit), its step thread alone under the default policy (`unbatch_this_thread`): the lanes'
receivers, the prefetch worker and the HTTP server then run while the step blocks, sleeps or ends its time slice,
and no longer cut into it each time a frame arrives (measured on this machine, random:32 at 2K in a burst of four:
the step thread was preempted 106-147 times a step, 35-38 batched; its time runnable but not running at batch 3 fell
from 8-21 to 2-4 ms a step; TBT moved less than the rounds' spread: docs/results/2026-12-07-step-thread-first.md).

`SMARTGEN_BACKGROUND_NICE` sets the niceness given (default 10; 0 leaves every thread as it is, its policy too).
Linux only: there a thread is its own schedulable task, where elsewhere `setpriority` would lower the whole process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

__all__ = [
    "BACKGROUND_NICE",
    "background_nice",
    "lower_this_thread",
    "batch_this_thread",
    "unbatch_this_thread",
    "preemptions",
]

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


def batch_this_thread() -> bool:
    """Puts the calling thread under SCHED_BATCH, and with it every thread it starts from now on (a Linux thread
    inherits its creator's policy): it keeps its fair share of the CPU but no longer preempts a running thread as it
    wakes. True when it did; never raises, and does nothing where `background_nice()` is 0."""
    if background_nice() <= 0:
        return False
    return _set_policy("SCHED_BATCH")


def unbatch_this_thread() -> bool:
    """Puts the calling thread back under the default policy (SCHED_OTHER), so that it preempts batched ones as it
    wakes: the latency-critical thread of a batched process (a decode node's step thread). True when it did."""
    return _set_policy("SCHED_OTHER")


def _set_policy(name: str) -> bool:
    policy = getattr(os, name, None)
    if policy is None or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.sched_getscheduler(tid)
        if current == policy or current not in (os.SCHED_OTHER, os.SCHED_BATCH):
            return False  # as asked already, or a policy someone chose on purpose (real-time, idle): left alone
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except OSError as exc:  # a sandbox that refuses
        log.debug("could not put thread %s under %s: %s", threading.current_thread().name, name, exc)
        return False
    return True


def preemptions() -> int:
    """How many times another thread has taken the calling thread's CPU while it could run (its involuntary context
    switches, `getrusage(RUSAGE_THREAD)`); 0 where the platform does not say. One system call: cheap per step."""
    who = getattr(resource, "RUSAGE_THREAD", None)  # None too where `resource` is missing
    if who is None:
        return 0
    try:
        return resource.getrusage(who).ru_nivcsw
    except OSError:
        return 0
