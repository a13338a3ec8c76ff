"""The link time one decode step's fetches take for the whole batch: what bounds TBT when requests share a link.

A step of B requests waits, layer by layer, for each member's fetch replies, and every reply crosses the one link
its prefill node paces. So the batch's fetched bytes per step, over the link's rate, is time the step cannot be
shorter than unless the fetches overlap compute: where it nears an all-local step (full transfer's TBT), TBT is the
link's, not the decode node's. Per round: the on-demand bytes per generated token (past the first), times the mean
batch a token shared its step with (`batch_seen`), over the link's rate.
"""

from __future__ import annotations

from typing import Any

__all__ = ["batch_seen", "fetch_link_per_step"]

_SAMPLES = 50  # instants per request at which its batch is counted


def batch_seen(requests: list[dict[str, Any]]) -> float | None:
    """The mean number of requests decoding beside (and including) a request, over each request's decoding time
    (first token to its stream's end, client clock, `sent` + `ttft` to `sent` + `e2e`); None with none finished."""
    spans = [
        (float(r["sent"]) + float(r["ttft"]), float(r["sent"]) + float(r["e2e"]))
        for r in requests
        if not r.get("error") and r.get("sent") is not None and r.get("ttft") is not None and r.get("e2e") is not None
    ]
    spans = [(start, end) for start, end in spans if end > start]
    if not spans:
        return None
    counts = []
    for start, end in spans:
        for i in range(_SAMPLES):
            at = start + (end - start) * (i + 0.5) / _SAMPLES
            counts.append(sum(1 for s, e in spans if s <= at < e))
    return sum(counts) / len(counts)


def fetch_link_per_step(
    requests: list[dict[str, Any]], on_demand_bytes: float, link_bytes_per_s: float
) -> float | None:
    """Seconds of the link the batch's fetches take per decode step, for one round's `requests` and their on-demand
    bytes in all; None without decode steps or a rate."""
    steps = sum(max(int(r.get("completion_tokens") or 0) - 1, 0) for r in requests if not r.get("error"))
    batch = batch_seen(requests)
    if not steps or batch is None or link_bytes_per_s <= 0:
        return None
    return on_demand_bytes / steps * batch / link_bytes_per_s
