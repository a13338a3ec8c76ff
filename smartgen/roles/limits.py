"""The decode node's timeouts and failure policy, in one place (what `smartgen serve` exposes as options)."""

from __future__ import annotations

from dataclasses import dataclass

from smartgen.lanes.liveness import DEFAULT_LEASE_S

__all__ = ["DecodeLimits", "ON_PREFILL_FAILURE"]

ON_PREFILL_FAILURE = ("fail", "recompute")


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Every wait the decode node does has a bound here; a request past one fails with the reason."""

    lease_s: float = DEFAULT_LEASE_S  # a prefill node silent this long is declared dead
    first_token_timeout_s: float = 120.0  # from dispatch to FIRST_TOKEN
    fetch_timeout_s: float = 30.0  # one decode step's wait for a request's on-demand fetch
    on_prefill_failure: str = "fail"  # "fail": its requests fail; "recompute": unfinished ones go to another node
    max_body_bytes: int = 4 * 2**20  # HTTP request bodies above this get 413 before they are read
    # a step waits this long for one request's fetch, then parks that request until it lands (None: no parking)
    fetch_stall_s: float | None = 1.0

    def __post_init__(self) -> None:
        if self.on_prefill_failure not in ON_PREFILL_FAILURE:
            raise ValueError(f"--on-prefill-failure must be one of {', '.join(ON_PREFILL_FAILURE)}")
        for name in ("lease_s", "first_token_timeout_s", "fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.fetch_stall_s is not None and not self.fetch_stall_s > 0:
            raise ValueError("fetch_stall_s must be positive (or None)")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
