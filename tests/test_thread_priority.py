"""Throughput threads give way to latency-critical ones: a lowered thread's niceness, the knob, the lanes that use it."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from conftest import wait_until

from smartgen.lanes.link import inproc_link
from smartgen.lanes.tcp_link import loopback_tcp_link
from smartgen.lanes.thread_priority import BACKGROUND_NICE, background_nice, lower_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


def nice_of(tid: int) -> int:
    """A thread's niceness as the kernel has it (/proc's stat, field 19)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def in_thread(fn) -> tuple[object, int, int]:
    """Runs fn in a fresh thread; returns its result and the thread's niceness before and after."""
    out: dict[str, object] = {}

    def run() -> None:
        tid = threading.get_native_id()
        out["before"] = nice_of(tid)
        out["result"] = fn()
        out["after"] = nice_of(tid)

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
