"""What every queue-driven lane endpoint shares: registered regions, accepted requests, the inbox and outbox.

Backends subclass `QueuedLane` and supply the threads that move the outbox to the peer.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Sequence

import torch

from smartgen.lanes.base import Completion, Landing, Lane, LaneCounters, Message, WriteOp, coalesce
from smartgen.lanes.extents import ExtentMap, SlotExtents
from smartgen.lanes.pacer import Pacer
from smartgen.lanes.thread_priority import lower_this_thread

__all__ = ["QueuedLane", "PriorityOutbox", "STOP"]

STOP = object()  # queued to wake every waiter when the endpoint closes


class PriorityOutbox(queue.Queue):
    """An outbox in order, except that a message of a higher `priority` goes after every queued item of a lower one
    (write batches, markers and STOP count as 0): a low-priority reply never delays a running request's fetch."""

    def _init(self, maxsize: int) -> None:
        self.queue: list[tuple[int, int, object]] = []
        self._seq = itertools.count()

    def _qsize(self) -> int:
        return len(self.queue)

    def _put(self, item: object) -> None:
        heapq.heappush(self.queue, (getattr(item, "priority", 0), next(self._seq), item))

    def _get(self) -> object:
        return heapq.heappop(self.queue)[2]


class QueuedLane(Lane):
    """Regions, acceptance and the two queues; `send`/`recv` done once for every backend."""

    def __init__(self, name: str, pacer: Pacer | None, bulk: bool) -> None:
        self.name = name
        self.bulk = bulk  # bulk lanes yield the link to urgent ones between chunks
        self.counters = LaneCounters()
        self._pacer = pacer or Pacer(None)
        self._regions: dict[str, torch.Tensor] = {}
        self._accepted: dict[str, SlotExtents | None] = {}  # request id -> where it may write (None: anywhere)
        self._apply_lock = threading.Lock()  # held while a batch lands, so revoke() waits for it
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = PriorityOutbox()
        self._closed = threading.Event()

    def _lower_if_bulk(self) -> None:
        """Called by a bulk lane's own threads as they start: pushes are throughput, so fetch replies and the decode
        step go first on a shared CPU (`thread_priority`)."""
        if self.bulk:
            lower_this_thread()

    # -- receiving side -------------------------------------------------------------
    def register_region(self, name: str, buffer: torch.Tensor) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("a region must be a flat, contiguous uint8 tensor")
        self._regions[name] = buffer

    def accept(self, request_id: str, extents: ExtentMap | None = None) -> None:
        allowed = None if extents is None else SlotExtents(extents)
        with self._apply_lock:
            self._accepted[request_id] = allowed

    def revoke(self, request_id: str) -> None:
        with self._apply_lock:
            self._accepted.pop(request_id, None)

    def _target(self, request_id: str, dst: str, offset: int, length: int) -> torch.Tensor | None:
        """The region a descriptor may land in, or None: request not accepted, unknown region, outside the
        region or outside the request's own extents (its slot). Call with the apply lock held."""
        if request_id not in self._accepted:
            return None
        region = self._regions.get(dst)
        if region is None or not 0 <= offset <= offset + length <= region.numel():
            return None
        allowed = self._accepted[request_id]
        return region if allowed is None or allowed.allows(dst, offset, length) else None

    # -- one-sided writes ---------------------------------------------------------------
    def _new_batch(self, ops: Sequence[WriteOp], tag: str) -> tuple[list[WriteOp], Completion, int]:
        """Coalesces a batch and counts it; the completion is already failed when the lane is closed."""
        merged = coalesce(ops)
        completion = Completion()
        if self._closed.is_set():
            completion.set(False)
            return merged, completion, 0
        num_bytes = sum(op.length for op in merged)
        self.counters.add_batch(tag, num_bytes, len(merged))
        return merged, completion, num_bytes

    # -- two-sided messages -----------------------------------------------------------
    def send(self, message: Message, *, tag: str = "control", landing: Landing | None = None) -> None:
        if self._closed.is_set():
            return
        self.counters.add_message(tag, message.payload_bytes)
        message.tag = f"{tag}/low" if message.priority > 0 else tag  # queued after the others: say so on the link
        if not self.bulk:
            self._pacer.urgent_enqueued()
        self._outbox.put(message)

    def recv(self, timeout: float | None = None) -> Message | None:
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is STOP:
            self._inbox.put(STOP)  # let every other receiver see it too
            if not self._closed.is_set():
                self.close()  # the peer hung up (in-process lanes): this end is closed too, so `closed` says so
            return None
        return item

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # -- for the backends' threads ------------------------------------------------------
    def _sleep_until(self, deadline: float) -> None:
        """Sleeps like the wire would, but wakes at once when the lane closes."""
        remaining = deadline - time.monotonic()
        if remaining > 0:
            self._closed.wait(remaining)

    def _fail(self, item: object) -> None:
        """Releases whoever waits on a queued item that will never go out (the backend knows its items)."""

    def _drain(self, *queues: queue.Queue) -> None:
        """Fails everything still queued when the lane closed; (arrival, item) pairs count as their item."""
        for source in queues:
            while True:
                try:
                    item = source.get_nowait()
                except queue.Empty:
                    break
                self._fail(item[1] if isinstance(item, tuple) else item)
