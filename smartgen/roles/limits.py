"""Each node's timeouts, bounds and failure policy, in one place (what `smartgen serve` exposes as options)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from smartgen.engine.prefill import DEFAULT_FLUSH_TIMEOUT_S
from smartgen.lanes.liveness import DEFAULT_LEASE_S
from smartgen.lanes.onesided import DEFAULT_CONFIRM_TIMEOUT_S, DEFAULT_WRITE_TIMEOUT_S, OneSidedTimeouts
from smartgen.lanes.tcp_link import DEFAULT_HANDSHAKE_TIMEOUT_S

__all__ = ["DecodeLimits", "PrefillLimits", "ON_PREFILL_FAILURE"]

ON_PREFILL_FAILURE = ("fail", "recompute")


def _check_seconds(limits: object, names: tuple[str, ...]) -> None:
    """Every named wait must be a positive, finite number of seconds (nan and inf would mean: never)."""
    for name in names:
        value = getattr(limits, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Every wait the decode node does has a bound here; a request past one fails with the reason."""

    lease_s: float = DEFAULT_LEASE_S  # a prefill node silent this long is declared dead
    first_token_timeout_s: float = 120.0  # waiting for FIRST_TOKEN (or its KV) with nothing arriving: a stall
    fetch_timeout_s: float = 30.0  # one decode step's wait for a request's on-demand fetch
    on_prefill_failure: str = "fail"  # "fail": its requests fail; "recompute": unfinished ones go to another node
    max_body_bytes: int = 4 * 2**20  # HTTP request bodies above this get 413 before they are read
    # a step waits this long for one request's fetch, then parks that request until it lands (None: no parking)
    fetch_stall_s: float | None = 1.0
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S  # connecting to a prefill node and authenticating
    confirm_timeout_s: float = DEFAULT_CONFIRM_TIMEOUT_S  # one-sided lanes: the peer's CONFIRM of ACCEPT/REVOKE
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S  # one-sided lanes: one write list completes
    queue_timeout_s: float = 300.0  # waiting for a free pool slot (then 503)
    # in a batch, a request whose fetches have held a step for its share of it (last step's own time / B) is held
    # back: it stays in the batch and redoes the step in the next (`DecodePath.step_share`)
    step_share: bool = True

    @property
    def one_sided(self) -> OneSidedTimeouts:
        return OneSidedTimeouts(self.confirm_timeout_s, self.write_timeout_s)

    def __post_init__(self) -> None:
        if self.on_prefill_failure not in ON_PREFILL_FAILURE:
            raise ValueError(
                f"--on-prefill-failure must be one of {', '.join(ON_PREFILL_FAILURE)}, got {self.on_prefill_failure!r}"
            )
        _check_seconds(
            self,
            (
                "lease_s",
                "first_token_timeout_s",
                "fetch_timeout_s",
                "handshake_timeout_s",
                "confirm_timeout_s",
                "write_timeout_s",
                "queue_timeout_s",
            ),
        )
        if self.fetch_stall_s is not None:
            _check_seconds(self, ("fetch_stall_s",))
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")


@dataclass(frozen=True, slots=True)
class PrefillLimits:
    """Every wait and every bound of a prefill node."""

    lease_s: float = DEFAULT_LEASE_S  # a decode node silent this long is declared dead and its requests freed
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S  # a connection authenticates within this or is closed
    confirm_timeout_s: float = DEFAULT_CONFIRM_TIMEOUT_S  # one-sided lanes: the peer's CONFIRM of ACCEPT/REVOKE
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S  # one-sided lanes: one write list completes
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S  # proactive-only: its proactive set lands before FIRST_TOKEN
    max_queue: int = 64  # OPENs waiting for prefill before new ones are refused
    max_store_bytes: int | None = (
        None  # K and V held for decode nodes at once; past it OPENs are refused (None: no cap)
    )

    def __post_init__(self) -> None:
        if self.max_store_bytes is not None and self.max_store_bytes < 1:
            raise ValueError(f"max_store_bytes must be positive, got {self.max_store_bytes}")
        _check_seconds(
            self, ("lease_s", "handshake_timeout_s", "confirm_timeout_s", "write_timeout_s", "flush_timeout_s")
        )

    @property
    def one_sided(self) -> OneSidedTimeouts:
        return OneSidedTimeouts(self.confirm_timeout_s, self.write_timeout_s)
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
