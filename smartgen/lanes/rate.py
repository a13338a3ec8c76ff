"""Link-time arithmetic, defined once: how long bytes take at a rate in Gbit/s, and the rate that moves bytes in a time."""

from __future__ import annotations

__all__ = ["bytes_per_second", "transfer_seconds", "gbps_for"]


def bytes_per_second(gbps: float) -> float:
    """A link rate in Gbit/s (10^9 bits per second) as bytes per second."""
    return gbps * 1e9 / 8


def transfer_seconds(num_bytes: float, gbps: float | None) -> float:
    """Seconds `num_bytes` take on a `gbps` link; 0 for an unpaced link (None or 0)."""
    if not gbps:
        return 0.0
    return num_bytes / bytes_per_second(gbps)


def gbps_for(num_bytes: float, seconds: float) -> float:
    """The rate in Gbit/s at which `num_bytes` take `seconds`."""
    if seconds <= 0:
        raise ValueError(f"a transfer time must be positive, got {seconds:g} s")
    return num_bytes * 8 / seconds / 1e9
