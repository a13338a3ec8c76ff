"""CPU seconds and scheduling policy of this process's threads, by role: what shares a node's CPUs with its decode step.

A decode step's `other` time (runnable, not running) is the node's other threads on its CPU: the lanes' receivers
landing pushes and replies, the prefetch worker, the HTTP server. The step table cannot say which; this can. Read
from `/proc/self/task/<tid>/stat` (Linux; elsewhere nothing), each thread named by its Python thread, lane threads
summed over links (their names carry the link's session: `decode.push.1a2b3c4d-rx` counts as `decode.push-rx`) and
threads Python did not start (torch's, the C library's) as `native`. A thread that has ended is no longer counted.
"""

from __future__ import annotations

import os
import re
import sys
import threading

__all__ = ["thread_cpu_seconds", "thread_policies", "role_of"]

_SESSION = re.compile(r"\.[0-9a-f]{8}-")  # a lane thread's link session (tcp_link names lanes by it)
_POOL_INDEX = re.compile(r"_\d+$")  # ThreadPoolExecutor's worker number


def role_of(name: str) -> str:
    """A thread's name without what differs between threads of one role: a link's session, a pool worker's number."""
    return _POOL_INDEX.sub("", _SESSION.sub("-", name))


def thread_cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds each live thread of this process has used, summed by `role_of` its name; {} off
    Linux or where /proc cannot be read."""
    if not sys.platform.startswith("linux"):
        return {}
    try:
        tids = os.listdir("/proc/self/task")
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return {}
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    seconds: dict[str, float] = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                # the command name, in parentheses, may hold spaces: the fields follow its closing one
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the thread ended between the listing and the read
        role = role_of(names.get(int(tid), "native"))
        seconds[role] = seconds.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return seconds


_POLICY_NAMES = {
    "SCHED_OTHER": "other",
    "SCHED_BATCH": "batch",
    "SCHED_IDLE": "idle",
    "SCHED_FIFO": "fifo",
    "SCHED_RR": "rr",
}


def thread_policies() -> dict[str, str]:
    """The scheduling policy of each live Python thread of this process, by `role_of` its name: "other" (the default:
    preempts as it wakes), "batch" (`thread_priority.batch_this_thread`: never does), "idle", "fifo", "rr"; a role
    whose threads differ lists them joined by "+". {} off Linux."""
    if not sys.platform.startswith("linux") or not hasattr(os, "sched_getscheduler"):
        return {}
    names = {getattr(os, name): short for name, short in _POLICY_NAMES.items() if hasattr(os, name)}
    found: dict[str, set[str]] = {}
    for thread in threading.enumerate():
        if thread.native_id is None:
            continue
        try:
            policy = os.sched_getscheduler(thread.native_id)
        except OSError:
            continue  # the thread ended between the listing and the read
        found.setdefault(role_of(thread.name), set()).add(names.get(policy, str(policy)))
    return {role: "+".join(sorted(kinds)) for role, kinds in sorted(found.items())}
