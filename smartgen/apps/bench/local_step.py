"""The all-local decode step at a batch size: how long a step takes when B requests decode together, every KV local.

Full transfer's TBT is an all-local step, but in a batch of concurrent requests it is rarely a batch-B step: its
requests join the decode batch one by one as their KV lands, so on a link that moves one request's KV in several
prefills they decode mostly alone. A scheme whose requests decode together pays a batch-B step instead, which on
a CPU costs more than a batch-1 step (selection, gathers and attention per request). The pilot measures that step
on unpaced nodes, where every request's KV lands at once: B full-transfer requests, long enough that all B decode
together for a while, and the median gap between a request's tokens while all of them are decoding.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

WINDOW_TOKENS = 24  # gaps wanted per request while all B decode together
MAX_TOKENS = 1024  # never ask for more per request, whatever the prefill/step ratio says


def pilot_tokens(batch: int, prefill_s: float, step_s: float) -> int:
    """Tokens each of `batch` concurrent requests generates so that the first is still decoding, with
    WINDOW_TOKENS to spare, when the last one's prefill (queued behind the others' on the one prefill node) is done:
    (batch - 1) prefills of decoding at batch-1 speed or better, with half as much again for margin."""
    if batch < 2:
        raise ValueError(f"a batch step needs at least 2 requests, got {batch}")
    if prefill_s <= 0 or step_s <= 0:
        raise ValueError(f"prefill and step times must be positive, got {prefill_s} and {step_s}")
    overlap = math.ceil(1.5 * (batch - 1) * prefill_s / step_s)
    return min(MAX_TOKENS, overlap + WINDOW_TOKENS)


def batch_step(streams: Sequence[tuple[float, Sequence[float]]]) -> float | None:
    """The median gap between consecutive tokens of any request while every request was decoding.

    `streams`: per request, (when it was sent, the arrival of each token counted from then), all on one clock. The
    window opens at the latest second token (every request has decoded a step) and closes at the earliest last
    token (one has left); gaps wholly inside it count. None when fewer than 3 gaps fall inside: the requests did
    not overlap long enough to say."""
    if len(streams) < 2 or any(len(arrivals) < 3 for _, arrivals in streams):
        return None
    opens = max(sent + arrivals[1] for sent, arrivals in streams)
    closes = min(sent + arrivals[-1] for sent, arrivals in streams)
    gaps = [
        b - a
        for sent, arrivals in streams
        for a, b in zip((sent + t for t in arrivals), (sent + t for t in arrivals[1:]))
        if opens <= a and b <= closes
    ]
    return statistics.median(gaps) if len(gaps) >= 3 else None
