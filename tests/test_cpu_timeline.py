"""A node's CPU second by second, by thread role: what each role used between two samples, in the second it was read."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from smartgen.roles.cpu_timeline import CpuTimeline


def test_each_sample_books_what_each_role_used_since_the_last_in_ms():
    reads = iter(
        [
            {"decode-scheduler": 1.0, "decode.push-rx": 0.5},  # the start: nothing booked
            {"decode-scheduler": 1.9, "decode.push-rx": 0.5, "smartgen-fetch": 0.05},
            {"decode-scheduler": 2.1, "decode.push-rx": 0.2},  # the receivers' link closed: no negative booking
        ]
    )
    timeline = CpuTimeline(read=lambda: next(reads))
    timeline.sample(at=10.2)
    timeline.sample(at=11.4)
    timeline.sample(at=12.9)
    assert timeline.snapshot() == {
        "bin_s": 1.0,
        "bins": [[11.0, {"decode-scheduler": 900, "smartgen-fetch": 50}], [12.0, {"decode-scheduler": 200}]],
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread CPU is read from /proc (Linux)")
def test_a_busy_thread_shows_under_its_role_while_the_sampler_runs():
    timeline = CpuTimeline(bin_s=0.1)
    timeline.start()
    deadline = time.monotonic() + 10  # a loaded machine gives the loop its 0.3 s of CPU more slowly

    def spin() -> None:
        while time.thread_time() < 0.3 and time.monotonic() < deadline:
            sum(range(1000))

    busy = threading.Thread(target=spin, name="busy-worker")
    busy.start()
    busy.join()
    timeline.stop()
    used = sum(counts.get("busy-worker", 0) for _, counts in timeline.snapshot()["bins"])
    # what it used up to the last sample before it ended (at most a bin's worth is lost; the clock ticks every 10 ms)
    assert used >= 150, timeline.snapshot()
