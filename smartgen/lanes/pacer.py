"""Caps a node's outgoing traffic at a link rate (Gbit/s) with an optional one-way delay.

All lanes of a node share one pacer, as they would share a NIC. The pacer is a virtual
clock of when the link is next free: reserving n bytes pushes it n·8/rate seconds on.
Bulk lanes book the link a chunk (about 2 ms of it) at a time and hold back while an urgent (on-demand)
transfer is queued, so a decode step's fetch waits for at most one bulk chunk, never for
a whole speculative slice.
"""

from __future__ import annotations

import threading
import time

from smartgen.lanes.link_timeline import LinkTimeline
from smartgen.lanes.rate import bytes_per_second

__all__ = ["Pacer"]

# Sleeping is coarse (tens of µs); letting the virtual clock lag real time by this much
# lets a sender catch up after an oversleep instead of losing link time for good.
CATCH_UP_SECONDS = 0.002
CHUNK_SECONDS = 0.002
MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 1024 * 1024


class Pacer:
    """A shared link: `reserve(n)` says when n bytes have finished crossing it."""

    def __init__(self, gbps: float | None = None, delay_s: float = 0.0) -> None:
        if gbps is not None and gbps <= 0:
            raise ValueError(f"link rate must be positive, got {gbps} Gbit/s")
        if delay_s < 0:
            raise ValueError(f"one-way delay must be >= 0, got {delay_s} s")
        self.gbps = gbps
        self.delay_s = delay_s
        self._next_free = 0.0
        self._lock = threading.Lock()
        self._num_urgent = 0
        self._urgent_changed = threading.Condition()
        # what the link carried, second by second and by tag (paced links only: an unpaced one books nothing)
        self.timeline = LinkTimeline()

    def urgent_enqueued(self) -> None:
        """An on-demand transfer is waiting for the link: bulk chunks hold back until it is booked."""
        with self._urgent_changed:
            self._num_urgent += 1

    def urgent_booked(self) -> None:
        with self._urgent_changed:
            self._num_urgent -= 1
            if self._num_urgent == 0:
                self._urgent_changed.notify_all()

    def wait_no_urgent(self, timeout: float | None = None) -> bool:
        """Blocks a bulk sender while on-demand transfers are queued for this link."""
        with self._urgent_changed:
            return self._urgent_changed.wait_for(lambda: self._num_urgent == 0, timeout)

    @property
    def bytes_per_second(self) -> float | None:
        return None if self.gbps is None else bytes_per_second(self.gbps)

    def chunk_bytes(self) -> int:
        """How much a bulk lane books at a time: about 2 ms of link time (4 KiB to 1 MiB).

        An urgent transfer waits for at most one booked chunk, so chunks follow the link rate:
        256 KiB would hold a fetch back 100 ms on a 20 Mbit/s link, but only 0.1 ms at 20 Gbit/s. The floor is
        small because benchmarks emulate slow links: a 16 KiB floor held each fetch back up to 5 ms at
        26 Mbit/s, as long as a 32-layer decode layer there, where a real link's 1 MiB chunk is a third of one.
        """
        rate = self.bytes_per_second
        if rate is None:
            return MAX_CHUNK_BYTES
        return int(min(max(rate * CHUNK_SECONDS, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES))

    def transfer_seconds(self, num_bytes: int) -> float:
        """How long num_bytes take on this link (0 when unpaced)."""
        rate = self.bytes_per_second
        return 0.0 if rate is None else num_bytes / rate

    def reserve(self, num_bytes: int, tag: str = "") -> float:
        """Books the link for num_bytes; returns the monotonic time they have been sent. `tag`: what they are, for
        the link's timeline (`link_timeline`)."""
        now = time.monotonic()
        if self.gbps is None:
            return now
        with self._lock:
            # An idle link starts now; a busy one continues its clock, even slightly in the past.
            start = self._next_free if self._next_free > now - CATCH_UP_SECONDS else now
            self._next_free = done = start + self.transfer_seconds(num_bytes)
        self.timeline.add(done, num_bytes, tag)
        return done

    def arrival(self, num_bytes: int, tag: str = "") -> float:
        """Books the link and adds the one-way delay: when the bytes reach the peer."""
        return self.reserve(num_bytes, tag) + self.delay_s


def sleep_until(deadline: float) -> None:
    """Sleeps until a monotonic deadline (no-op when it has passed)."""
    remaining = deadline - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)
