"""The CPU seconds a node reports per thread role (its /status `threads_cpu`, the bench's `decode_threads`)."""

import sys
import threading
import time

import pytest

from smartgen.lanes.thread_priority import batch_this_thread
from smartgen.roles.thread_cpu import role_of, thread_cpu_seconds, thread_policies


def test_a_threads_role_drops_its_links_session_and_its_pool_number():
    assert role_of("decode.push.1a2b3c4d-rx") == "decode.push-rx"
    assert role_of("prefill.control.cf8fa9eb-tx") == "prefill.control-tx"
    assert role_of("smartgen-fetch_0") == "smartgen-fetch"
    assert role_of("decode-scheduler") == "decode-scheduler"
    assert role_of("AnyIO worker thread") == "AnyIO worker thread"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task (Linux)")
def test_a_busy_thread_is_counted_under_its_role_while_it_lives():
    stop = threading.Event()
    busy = threading.Event()

    def spin() -> None:
        started = time.thread_time()
        while not stop.is_set():
            if time.thread_time() - started > 0.2:
                busy.set()

    threads = [threading.Thread(target=spin, name=f"decode.push.{s}-rx", daemon=True) for s in ("1a2b3c4d", "5e6f7a8b")]
    for thread in threads:
        thread.start()
    try:
        assert busy.wait(30)
        seconds = thread_cpu_seconds()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    # both links' receivers in one role, with at least most of the 0.2 s one of them spun (/proc counts in ticks)
    assert seconds["decode.push-rx"] >= 0.15
    assert not any("1a2b3c4d" in role for role in seconds)
    assert all(value >= 0 for value in seconds.values())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling policies per thread are Linux's")
def test_each_roles_policy_is_reported_and_a_role_whose_threads_differ_lists_both(monkeypatch):
    monkeypatch.delenv("SMARTGEN_BACKGROUND_NICE", raising=False)
    release = threading.Event()
    ready = [threading.Event() for _ in range(3)]

    def hold(index: int, batched: bool) -> None:
        if batched:
            assert batch_this_thread()
        ready[index].set()
        release.wait(30)

    threads = [
        threading.Thread(target=hold, args=(0, True), name="decode.push.1a2b3c4d-rx", daemon=True),
        threading.Thread(target=hold, args=(1, False), name="decode.push.5e6f7a8b-rx", daemon=True),
        threading.Thread(target=hold, args=(2, True), name="smartgen-fetch_0", daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        assert all(event.wait(30) for event in ready)
        policies = thread_policies()
    finally:
        release.set()
        for thread in threads:
            thread.join()
    assert policies["decode.push-rx"] == "batch+other"
    assert policies["smartgen-fetch"] == "batch"
    assert policies["MainThread"] == "other"
