"""Pairs a decode node's two connections (push, control) by session id; half pairs expire and are capped.

Each authenticated connection names its session and channel. The listener keeps it here until the session's
other channel arrives; then both leave as one link. A peer that opens one channel and never the other (a crash
between the two connects, or a peer that holds connections on purpose) would otherwise keep its lane, socket
and threads forever, so a half pair lives at most `timeout_s`, at most `max_pending` wait at once, and a second
connection for a channel a session already has is refused. Not thread-safe: the listener holds its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from smartgen.lanes.base import Lane

__all__ = ["Pairing", "PairingRefused"]


class PairingRefused(ConnectionError):
    """A connection that cannot wait for its partner (the reason says why); the caller closes its lane."""


@dataclass(slots=True)
class _Half:
    since: float
    lanes: dict[str, Lane] = field(default_factory=dict)


class Pairing:
    """Sessions waiting for their other channel."""

    def __init__(
        self,
        channels: tuple[str, ...],
        max_pending: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.channels = channels
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self._clock = clock
        self._waiting: dict[str, _Half] = {}

    def add(self, session: str, channel: str, lane: Lane) -> dict[str, Lane] | None:
        """Files `lane` under its session; returns every channel's lane once the pair is whole, else None.
        PairingRefused when the session already has this channel or too many sessions wait already."""
        half = self._waiting.get(session)
        if half is None:
            if len(self._waiting) >= self.max_pending:
                raise PairingRefused(f"more than {self.max_pending} sessions wait for their other connection")
            half = self._waiting[session] = _Half(self._clock())
        elif channel in half.lanes:
            raise PairingRefused(f"a second {channel} connection for session {session[:8]}")
        half.lanes[channel] = lane
        if len(half.lanes) < len(self.channels):
            return None
        del self._waiting[session]
        return half.lanes

    def expire(self) -> list[tuple[str, Lane]]:
        """Takes out the half pairs older than `timeout_s` or whose lane closed meanwhile: (reason, lane) to close."""
        now = self._clock()
        gone = []
        for session, half in list(self._waiting.items()):
            closed = any(getattr(lane, "closed", False) for lane in half.lanes.values())  # lease expired, hung up
            if closed or now - half.since > self.timeout_s:
                del self._waiting[session]
                have = ", ".join(half.lanes)
                why = "closed" if closed else f"not paired within {self.timeout_s:g} s"
                gone += [(f"session {session[:8]} ({have} only): {why}", lane) for lane in half.lanes.values()]
        return gone

    def drain(self) -> list[Lane]:
        """Every waiting lane (the listener is closing)."""
        lanes = [lane for half in self._waiting.values() for lane in half.lanes.values()]
        self._waiting.clear()
        return lanes

    def __len__(self) -> int:
        return len(self._waiting)
