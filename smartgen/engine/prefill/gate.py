"""One link's push schedule across requests: speculation waits while pushes fill the link's room ahead.

Every request on a prefill node chains its own speculative slices; with several requests on one link, their slices
queued on the push lane ahead of a new request's proactive set, which its time to second token waits for. The gate
keeps, per link, the bytes of pushes posted and not landed (proactive and speculative alike) and lets a speculative
slice go only while they are under the link's room ahead (`SPECULATION_AHEAD_S` of its rate). Proactive pushes
never wait: they go straight behind at most that much speculation. A request that finds no room waits in the
link's queue, in turn; each landing hands the freed room to the next one waiting (round robin across requests).

Because a waiting slice is planned only when it gets room, a fetch answered meanwhile has cleared its entries
from the request's unsent set: what a fetch brought is trimmed from every push not yet on the link.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

__all__ = ["PushGate", "SPECULATION_AHEAD_S"]

# link time of pushes that may wait ahead of a new proactive set: two chained slices (decide.CHAIN_WINDOW_S), so one
# is on the wire while the next is planned and the link does not idle between them
SPECULATION_AHEAD_S = 0.02


@dataclass(slots=True)
class _LinkState:
    in_flight: int = 0  # bytes posted on the link's push lane and not landed
    waiting: deque[str] = field(default_factory=deque)  # request ids whose speculation waits for room, in turn


class PushGate:
    """Per link (any hashable key): pushes in flight, and the requests whose speculation waits for room."""

    def __init__(self, ahead_s: float = SPECULATION_AHEAD_S) -> None:
        if ahead_s <= 0:
            raise ValueError("the room ahead must be positive")
        self.ahead_s = ahead_s
        self._lock = threading.Lock()
        self._links: dict[object, _LinkState] = {}

    def room(self, link_rate: float) -> float:
        """Bytes of pushes allowed ahead at `link_rate` bytes/s; unmeasured (0): no limit."""
        return link_rate * self.ahead_s if link_rate > 0 else float("inf")

    def try_speculate(self, key: object, request_id: str, link_rate: float) -> bool:
        """Whether `request_id` may post a speculative slice now; if not, it joins the link's queue (once)."""
        with self._lock:
            state = self._links.setdefault(key, _LinkState())
            if state.in_flight < self.room(link_rate) and (not state.waiting or state.waiting[0] == request_id):
                if state.waiting:
                    state.waiting.popleft()
                return True
            if request_id not in state.waiting:
                state.waiting.append(request_id)
            return False

    def posted(self, key: object, num_bytes: int) -> None:
        with self._lock:
            self._links.setdefault(key, _LinkState()).in_flight += num_bytes

    def landed(self, key: object, num_bytes: int, link_rate: float) -> str | None:
        """A push of `num_bytes` landed (or failed); returns the request whose turn it now is, if room opened."""
        with self._lock:
            state = self._links.get(key)
            if state is None:
                return None
            state.in_flight = max(0, state.in_flight - num_bytes)
            if state.waiting and state.in_flight < self.room(link_rate):
                return state.waiting[0]
            return None

    def next_waiting(self, key: object, link_rate: float) -> str | None:
        """The request first in the link's queue if there is room for it now."""
        with self._lock:
            state = self._links.get(key)
            if state is None or not state.waiting or state.in_flight >= self.room(link_rate):
                return None
            return state.waiting[0]

    def drop(self, key: object, request_id: str) -> None:
        """`request_id` no longer speculates on the link (released, or nothing left to send)."""
        with self._lock:
            state = self._links.get(key)
            if state is not None and request_id in state.waiting:
                state.waiting.remove(request_id)

    def forget(self, key: object) -> None:
        """The link closed: its queue and counts go."""
        with self._lock:
            self._links.pop(key, None)

    def in_flight(self, key: object) -> int:
        with self._lock:
            state = self._links.get(key)
            return state.in_flight if state is not None else 0

    def waiting(self, key: object) -> list[str]:
        with self._lock:
            state = self._links.get(key)
            return list(state.waiting) if state is not None else []
