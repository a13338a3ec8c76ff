"""Throughput threads give way to latency-critical ones: a lowered thread's niceness, the knob, the lanes that use it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_until

from smartgen.lanes.link import inproc_link
from smartgen.lanes.tcp_link import loopback_tcp_link
from smartgen.lanes.thread_priority import (
    BACKGROUND_NICE,
    background_nice,
    batch_this_thread,
    lower_this_thread,
    preemptions,
    unbatch_this_thread,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


def nice_of(tid: int) -> int:
    """A thread's niceness as the kernel has it (/proc's stat, field 19)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def in_thread(fn, read=nice_of) -> tuple[object, int, int]:
    """Runs fn in a fresh thread; returns its result and what `read` says of the thread (its niceness by default)
    before and after."""
    out: dict[str, object] = {}

    def run() -> None:
        tid = threading.get_native_id()
        out["before"] = read(tid)
        out["result"] = fn()
        out["after"] = read(tid)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["result"], int(out["before"]), int(out["after"])  # type: ignore[call-overload]


def test_a_lowered_thread_gains_the_background_niceness_and_nothing_else_changes(monkeypatch) -> None:
    monkeypatch.delenv("SMARTGEN_BACKGROUND_NICE", raising=False)
    main_before = nice_of(threading.get_native_id())
    done, before, after = in_thread(lower_this_thread)
    assert done is True
    assert after == min(before + BACKGROUND_NICE, 19)
    assert nice_of(threading.get_native_id()) == main_before  # only the calling thread, not the process


@pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("5", 5), ("40", 19), ("-3", 0), ("soon", BACKGROUND_NICE)])
def test_the_knob_is_read_clamped_and_a_bad_value_falls_back_to_the_default(monkeypatch, raw, expected) -> None:
    monkeypatch.setenv("SMARTGEN_BACKGROUND_NICE", raw)
    assert background_nice() == expected


def test_zero_leaves_every_thread_as_it_is(monkeypatch) -> None:
    monkeypatch.setenv("SMARTGEN_BACKGROUND_NICE", "0")
    done, before, after = in_thread(lower_this_thread)
    assert done is False and after == before


@pytest.mark.parametrize("kind", ["tcp", "inproc"])
def test_a_links_push_lanes_run_lowered_at_both_ends_and_its_control_lanes_do_not(monkeypatch, kind) -> None:
    """The pushes' send and receive threads are throughput; the control lanes carry fetches and their replies."""
    monkeypatch.delenv("SMARTGEN_BACKGROUND_NICE", raising=False)
    base = nice_of(threading.get_native_id())
    prefill, decode = loopback_tcp_link() if kind == "tcp" else inproc_link()
    try:
        for end in (prefill, decode):
            for lane, lowered in ((end.push, True), (end.control, False)):
                for thread in lane._threads[:2]:  # transmit and receive
                    assert thread.native_id is not None
                    expected = min(base + BACKGROUND_NICE, 19) if lowered else base
                    tid = thread.native_id
                    # the thread lowers itself as it starts: wait until it has run that far
                    wait_until(
                        lambda t=tid, n=expected: nice_of(t) == n, 2.0, f"{lane.name} {thread.name} at nice {expected}"
                    )
                    assert nice_of(tid) == expected, (lane.name, thread.name)
    finally:
        prefill.close()
        decode.close()


def policy_in_thread(fn) -> tuple[object, int, int]:
    """Runs fn in a fresh thread; returns its result and the thread's scheduling policy before and after."""
    return in_thread(fn, os.sched_getscheduler)


def test_a_batched_thread_and_the_threads_it_starts_run_batched_and_unbatching_restores(monkeypatch) -> None:
    """What a decode node relies on: its process batches itself before any thread starts, and they inherit it."""
    monkeypatch.delenv("SMARTGEN_BACKGROUND_NICE", raising=False)
    main_before = os.sched_getscheduler(threading.get_native_id())

    def batch_then_start_one() -> tuple[bool, int, bool, int]:
        done = batch_this_thread()
        child = policy_in_thread(lambda: None)  # started after: inherits SCHED_BATCH
        back = policy_in_thread(unbatch_this_thread)  # a step thread going back to the default
        return done, child[1], bool(back[0]), back[2]

    (done, child, unbatched, child_after), before, after = policy_in_thread(batch_then_start_one)
    assert before == os.SCHED_OTHER and done and after == os.SCHED_BATCH
    assert child == os.SCHED_BATCH
    assert unbatched and child_after == os.SCHED_OTHER
    assert os.sched_getscheduler(threading.get_native_id()) == main_before  # the caller's thread only
    assert policy_in_thread(batch_this_thread)[0] is True and policy_in_thread(unbatch_this_thread)[0] is False


def test_zero_batches_nothing_and_a_policy_chosen_on_purpose_is_left_alone(monkeypatch) -> None:
    monkeypatch.setenv("SMARTGEN_BACKGROUND_NICE", "0")
    done, before, after = policy_in_thread(batch_this_thread)
    assert done is False and after == before == os.SCHED_OTHER
    monkeypatch.delenv("SMARTGEN_BACKGROUND_NICE")

    def idle_then_batch() -> bool:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))  # no privileges needed
        return batch_this_thread()

    done, _, after = policy_in_thread(idle_then_batch)
    assert done is False and after == os.SCHED_IDLE


def test_a_thread_that_shares_its_cpu_with_a_busy_process_counts_its_preemptions() -> None:
    """`preemptions()`: the calling thread's involuntary context switches, the decode step's `pre` in the bench."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})

        def spin_on_the_hogs_cpu() -> tuple[int, int]:
            os.sched_setaffinity(threading.get_native_id(), {cpu})
            before = preemptions()
            started = time.monotonic()
            while time.monotonic() - started < 0.3:
                pass
            return before, preemptions()

        (before, after), _, _ = policy_in_thread(spin_on_the_hogs_cpu)
    finally:
        hog.kill()
        hog.wait()
    assert after - before > 0  # the scheduler's time slices are a few ms: 0.3 s shared is dozens of them
    assert preemptions() >= 0
