"""Percentiles as the bench reports them (linear between ranks), apart so that any bench module may use them."""

from __future__ import annotations

__all__ = ["percentile"]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
