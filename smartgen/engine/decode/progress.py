"""What of a request's KV has arrived on the decode node, and when it last grew: the first-token bound judges this
progress (a stall), not how long a transfer takes.

The signal is the request's mask. Every lane writes a push's mask entries after its data (data before mask), so the
count of a request's LOCAL entries grows as its KV lands, whatever the lane: one-sided writes (RDMA, Mooncake, NIXL)
never pass through this node's CPU, so no lane-level byte counter could see them. A quantized layer counts once the
flag after its packed bytes is set (its mask turns LOCAL later, when it is dequantized). Messages for a request
(METADATA, FIRST_TOKEN, a FETCH reply) count the moment they arrive. A push's masks land at the end of its batch
(one layer of one request, or one speculative slice), so that is the grain of progress a link shows.

A link moves transfers in turn (a prefill node prefills in order, its push lane is FIFO), so a request queued behind
others on its link is judged with theirs: what arrives for the requests dispatched before it is progress for it too,
and so is the last arrival of one that has left (its turn ended, the next began).

A count is one pass over the request's [L, n, H] int8 mask (about 8M entries, a few ms, at 32 layers, 32K tokens
and 8 KV heads), so a request is counted at most once per `scan_interval(bound)`, a twentieth of the bound: a stall
is seen at most that late.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from smartgen.engine.decode.decide import DecodeFlags
from smartgen.engine.mask import LOCAL
from smartgen.engine.pool import DecodePool

__all__ = ["Arrival", "Stall", "Watched", "judge", "landed_entries", "scan_interval"]

SCANS_PER_BOUND = 20


def scan_interval(bound: float) -> float:
    """How often a request's mask is counted while a bound of `bound` seconds watches it."""
    return max(bound / SCANS_PER_BOUND, 0.005)


def landed_entries(pool: DecodePool, slot: int, length: int, quantized: bool) -> int:
    """The request's prompt KV entries (token, KV head, every layer) in the pool, or landed packed (quant2)."""
    pool.sync_staged(None, [slot])  # staged: what the lanes landed is marked in the table first
    landed = int((pool.masks.values[:, slot, :length] == LOCAL).sum())
    if quantized:  # a flagged layer's mask is still REMOTE: it turns LOCAL when the driver's thread dequantizes it
        landed += int(pool.quant_ready[:, slot].sum()) * length * pool.masks.num_heads
    return landed


@dataclass(slots=True)
class Arrival:
    """One request's progress: its dispatch order (it may queue behind the requests dispatched before it on its
    link), its entries counted landed at the last scan, and the last time anything arrived for it."""

    num_entries: int  # its prompt's KV entries: layers x tokens x KV heads
    order: int  # dispatch order among the engine's requests (opened again elsewhere: a new one)
    dispatched_at: float  # time.monotonic()
    num_landed: int = 0  # at the last scan (at open: what the prefix cache put in its slot)
    last_at: float = field(init=False)  # when something last arrived for it (dispatch, until something does)
    scanned_at: float = field(init=False)  # its last count (dispatch, until counted)
    # the last arrival for requests ahead of it on its link that have left since (their turn ended, its began)
    left_ahead_at: float = field(init=False)
    judged_at: float = field(init=False)  # when `judge` last looked at it

    def __post_init__(self) -> None:
        self.last_at = self.scanned_at = self.left_ahead_at = self.judged_at = self.dispatched_at

    def judge_due(self, now: float, bound: float) -> bool:
        """Whether to judge it now: at most once per `scan_interval(bound)`, so a driver polling every millisecond
        costs a comparison between looks (a stall is seen at most an interval late either way)."""
        if now - self.judged_at < scan_interval(bound):
            return False
        self.judged_at = now
        return True

    def note(self, now: float) -> None:
        """A message for it arrived (METADATA, FIRST_TOKEN, a FETCH reply)."""
        self.last_at = max(self.last_at, now)

    def count(self, num_landed: int, now: float, since: float) -> None:
        """A scan found `num_landed` entries landed, for a watcher dispatched at `since` (the request itself, or one
        queued behind it). Growth counts as an arrival now when the scan before was at or after `since`; after an
        older one (a request ahead, first looked at for this watcher) it may predate the watcher, so it only sets
        the count."""
        if num_landed > self.num_landed and self.scanned_at >= since:
            self.last_at = max(self.last_at, now)
        self.num_landed = min(max(self.num_landed, num_landed), self.num_entries)
        self.scanned_at = now

    def redispatch(self, order: int, now: float) -> None:
        """Opened again on another prefill node: it queues anew behind that link's requests."""
        self.order, self.dispatched_at = order, now
        self.last_at = self.scanned_at = self.left_ahead_at = self.judged_at = now

    def ahead_left(self, last_at: float) -> None:
        """A request ahead of it on its link left, its last arrival at `last_at`: that still counts (the link moved
        that request's KV, then turns to the next)."""
        self.left_ahead_at = max(self.left_ahead_at, last_at)

    @property
    def complete(self) -> bool:
        return self.num_landed >= self.num_entries


class Stall(NamedTuple):
    """Nothing arrived for a request, nor for the requests dispatched before it on its link, for `idle_s`."""

    idle_s: float
    num_landed: int  # its prompt's KV entries landed
    num_entries: int
    last_s: float | None  # seconds after its dispatch that something last arrived for it (None: nothing has)
    num_ahead: int  # requests dispatched before it on its link, still open
    behind: bool  # something arrived for requests ahead of it after its own last arrival: it waited behind them

    def describe(self, bound: float) -> str:
        """What the request's error says: how long nothing came, against which bound, and how much had arrived."""
        ahead = " nor for the requests queued ahead of it on its link" if self.behind else ""
        share = 100 * self.num_landed / max(self.num_entries, 1)
        landed = f"{self.num_landed} of its {self.num_entries} KV entries had arrived ({share:.0f}%)"
        if self.last_s is None:
            last = "nothing had come since its dispatch"
        else:
            last = f"the last arrival was {self.last_s:.1f} s after its dispatch"
        return f"nothing arrived for it{ahead} for {self.idle_s:.1f} s (bound {bound:g} s); {landed}; {last}"


class Watched(Protocol):
    """What `judge` reads of a request (a `DecodeRequest`, which imports this module)."""

    slot: int
    length: int
    flags: DecodeFlags
    arrival: Arrival


def judge(pool: DecodePool, request: Watched, ahead: Sequence[Watched], bound: float, now: float) -> Stall | None:
    """Whether nothing has arrived for `request`, nor for the requests `ahead` of it on its link, for over `bound`
    seconds at `now`; counts the masks of those not counted for `scan_interval(bound)` first."""
    interval = scan_interval(bound)
    since = request.arrival.dispatched_at
    for watched in (request, *ahead):
        progress = watched.arrival
        if not progress.complete and now - progress.scanned_at >= interval:
            progress.count(landed_entries(pool, watched.slot, watched.length, watched.flags.quantized), now, since)
    own = request.arrival
    queued = max([own.left_ahead_at, *(watched.arrival.last_at for watched in ahead)])
    last = max(own.last_at, queued)
    if now - last <= bound:
        return None
    last_s = own.last_at - own.dispatched_at if own.last_at > own.dispatched_at else None
    return Stall(now - last, own.num_landed, own.num_entries, last_s, len(ahead), queued > own.last_at)
