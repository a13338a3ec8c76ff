"""Bytes a paced link carried over time, by what they were (a lane's tag): where a link's time went, second by second.

The pacer books every chunk a lane sends; each booking is counted here in the bin of the moment its bytes have
crossed, under the tag the lane posted it with (`proactive`, `speculative`, `on_demand`, `metadata`, `control`, ...;
a fetch reply a forecast asked for, queued after the others, as `on_demand/low`). Bins are one second of the
monotonic clock, the last hour kept, so a bench on the same machine can cut a round's seconds out of a node's
`/status`.
"""

from __future__ import annotations

import math
import threading
from typing import Any

__all__ = ["LinkTimeline", "between", "merged", "OTHER_TAG"]

OTHER_TAG = "other"  # bytes booked without a tag (lanes that do not say what they send)


class LinkTimeline:
    """Per `bin_s` of the monotonic clock, the bytes booked on a link by tag; the last `keep_bins` bins."""

    def __init__(self, bin_s: float = 1.0, keep_bins: int = 3600) -> None:
        if bin_s <= 0 or keep_bins <= 0:
            raise ValueError("a link timeline needs positive bins")
        self.bin_s = bin_s
        self.keep_bins = keep_bins
        self._bins: dict[int, dict[str, int]] = {}  # bin index -> {tag: bytes}
        self._lock = threading.Lock()

    def add(self, at: float, num_bytes: int, tag: str = "") -> None:
        """`num_bytes` crossed by monotonic time `at` (a booking's end; bookings come nearly in order of it)."""
        index = math.floor(at / self.bin_s)
        tag = tag or OTHER_TAG
        with self._lock:
            counts = self._bins.get(index)
            if counts is None:
                counts = self._bins[index] = {}
                if len(self._bins) > self.keep_bins:  # a new bin: the oldest goes (once a second at most)
                    del self._bins[min(self._bins)]
                    if index not in self._bins:
                        return  # older than what is kept
            counts[tag] = counts.get(tag, 0) + num_bytes

    def snapshot(self) -> dict[str, Any]:
        """{"bin_s": seconds a bin, "bins": [[bin start (monotonic s), {tag: bytes}], ...]} in time order."""
        with self._lock:
            return {"bin_s": self.bin_s, "bins": [[i * self.bin_s, dict(self._bins[i])] for i in sorted(self._bins)]}


def merged(snapshots: list[dict[str, Any]], bin_s: float = 1.0) -> dict[str, Any]:
    """Several links' timelines (same bin width) as one snapshot of their sums, bin by bin and tag by tag: what a
    node's links carried together (a colocated node's in-process links, one per connection)."""
    widths = {s["bin_s"] for s in snapshots if s.get("bins")}
    if len(widths) > 1:
        raise ValueError(f"link timelines of different bin widths: {sorted(widths)}")
    width = widths.pop() if widths else bin_s
    bins: dict[int, dict[str, int]] = {}
    for snapshot in snapshots:
        for bin_start, counts in snapshot.get("bins", []):
            summed = bins.setdefault(round(bin_start / width), {})
            for tag, num_bytes in counts.items():
                summed[tag] = summed.get(tag, 0) + int(num_bytes)
    return {"bin_s": width, "bins": [[i * width, bins[i]] for i in sorted(bins)]}


def between(snapshots: list[dict[str, Any]], start: float, end: float) -> dict[str, list[int]]:
    """The bytes of one or more links' timelines (`LinkTimeline.snapshot`, same bin width) in each bin from the
    one holding `start` to the one holding `end` (monotonic seconds), summed over the links (`merged`), by tag:
    {tag: [bytes of bin 0, bin 1, ...]}. {} without bins."""
    summed = merged(snapshots)
    width = summed["bin_s"]
    first, last = math.floor(start / width), math.floor(end / width)
    series: dict[str, list[int]] = {}
    if not summed["bins"] or last < first:
        return series
    for bin_start, counts in summed["bins"]:
        index = round(bin_start / width)
        if first <= index <= last:
            for tag, num_bytes in counts.items():
                series.setdefault(tag, [0] * (last - first + 1))[index - first] += num_bytes
    return series
