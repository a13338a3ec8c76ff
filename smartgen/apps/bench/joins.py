"""What a request joining a running batch costs the others: their token gaps in the window of its join.

In a round of `--batch` concurrent requests (sent together), a request *joins* when it starts decoding while others
already are. Its window runs from its first token to the first its decode node computed (the second; the third when
the prefill node's forecast step gave the second, `prefill_tokens` 2), as the client saw them: the span in which its
first decode step waits for layers 0-1 and its first fetches (from its arrival would take in the prefill queue of a
batch sent at once). The requests *running* then are the others decoding (past the first token their decode node
computed, not past their last) at some time in the window: one that starts decoding while the joiner still waits for
its step shares the batch with it all the same. Their gaps (between consecutive tokens from the first their decode
node computed on) that overlap the window are what the join may stretch; per join, their p99. Full transfer's joins
(decoding once the KV is whole) are the baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smartgen.apps.bench.percentiles import percentile

__all__ = ["Join", "find_joins"]


@dataclass(frozen=True, slots=True)
class Join:
    """One request joining others that were decoding; times in seconds from its round's start (client clock)."""

    request: int  # its index in the round
    start: float  # its first token
    end: float  # its second token
    running: int  # the requests decoding at some time in [start, end]
    gaps: int  # their gaps that overlap [start, end]
    p99: float  # of those gaps, seconds

    def __post_init__(self) -> None:
        if not (self.end >= self.start and self.running > 0 and self.gaps > 0):
            raise ValueError(f"not a join: {self}")


def _arrivals(request: dict[str, Any]) -> list[float]:
    """A finished request's token arrivals from its round's start (`sent` + its own `ctl`); [] when it failed."""
    if request.get("error") or request.get("sent") is None:
        return []
    return [request["sent"] + t for t in request.get("ctl") or []]


def find_joins(requests: list[dict[str, Any]]) -> list[Join]:
    """Every join of one round of concurrent requests (each with `sent` and the client's `ctl`), in request order."""
    arrivals = [_arrivals(r) for r in requests]
    # each request's token arrivals from the first its decode node computed on
    decoded = [times[int(r.get("prefill_tokens") or 1) :] for r, times in zip(requests, arrivals)]
    joins = []
    for j, mine in enumerate(arrivals):
        if not decoded[j]:
            continue
        start, end = mine[0], decoded[j][0]
        running = [d for i, d in enumerate(decoded) if i != j and len(d) > 1 and d[0] < end and d[-1] > start]
        gaps = [b - a for times in running for a, b in zip(times, times[1:]) if b > start and a < end]
        if gaps:
            joins.append(Join(j, start, end, len(running), len(gaps), percentile(gaps, 99) or 0.0))
    return joins
