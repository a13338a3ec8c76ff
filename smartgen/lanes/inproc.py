"""An in-process lane: two endpoints joined by queues and threads, optionally paced to a link rate.

Each endpoint runs two threads for what it posts: a transmit thread that books the pacer
(so the link is busy for as long as the bytes would take) and a delivery thread that waits
out the one-way delay and applies writes to the peer's regions / queues messages into the
peer's inbox. One queue per direction keeps everything in posting order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from smartgen.lanes.base import Completion, Message, WriteOp
from smartgen.lanes.pacer import Pacer
from smartgen.lanes.queued import STOP, QueuedLane

__all__ = ["InprocLane"]


@dataclass(slots=True)
class _WriteBatch:
    request_id: str
    sources: Mapping[str, torch.Tensor]
    ops: list[WriteOp]
    completion: Completion
    num_bytes: int
    tag: str = ""  # what it is, for the link's timeline


@dataclass(slots=True)
class _Marker:
    completion: Completion


class InprocLane(QueuedLane):
    """One endpoint; make connected pairs with `InprocLane.pair()`."""

    def __init__(self, name: str, pacer: Pacer | None, bulk: bool = False) -> None:
        super().__init__(name, pacer, bulk)
        self._peer: InprocLane | None = None
        self._in_flight: queue.Queue[tuple[float, object]] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._transmit_loop, name=f"{name}-tx", daemon=True),
            threading.Thread(target=self._deliver_loop, name=f"{name}-rx", daemon=True),
        ]

    @classmethod
    def pair(
        cls, name: str, pacer_a: Pacer | None = None, pacer_b: Pacer | None = None, bulk: bool = False
    ) -> tuple[InprocLane, InprocLane]:
        """Two connected endpoints; each side's outgoing traffic is paced by its own pacer."""
        a, b = cls(f"{name}.a", pacer_a, bulk), cls(f"{name}.b", pacer_b, bulk)
        a._peer, b._peer = b, a
        for thread in a._threads + b._threads:
            thread.start()
        return a, b

    # -- receiving side -------------------------------------------------------------
    def _apply(self, batch: _WriteBatch) -> bool:
        with self._apply_lock:
            if batch.request_id not in self._accepted:
                return False
            applied = True
            for op in batch.ops:
                dst = self._target(batch.request_id, op.dst, op.dst_offset, op.length)
                if dst is None:  # outside the request's slot: dropped, like on the wire lanes
                    applied = False
                    continue
                src = batch.sources[op.src]
                dst[op.dst_offset : op.dst_offset + op.length].copy_(src[op.src_offset : op.src_offset + op.length])
            return applied

    # -- sending side ---------------------------------------------------------------
    def post_writes(
        self, request_id: str, sources: Mapping[str, torch.Tensor], ops: Sequence[WriteOp], *, tag: str
    ) -> Completion:
        merged, completion, num_bytes = self._new_batch(ops, tag)
        if completion.done():
            return completion
        self._outbox.put(_WriteBatch(request_id, sources, merged, completion, num_bytes, tag))
        return completion

    def flush(self, timeout: float | None = None) -> bool:
        marker = _Marker(Completion())
        self._outbox.put(marker)
        return marker.completion.wait(timeout)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._outbox.put(STOP)
        self._inbox.put(STOP)
        if self._peer is not None:
            self._peer._inbox.put(STOP)

    # -- threads ----------------------------------------------------------------------
    def _transmit_loop(self) -> None:
        self._lower_if_bulk()
        while True:
            item = self._outbox.get()
            if item is STOP:
                self._in_flight.put((0.0, STOP))
                return
            num_bytes = (
                item.num_bytes
                if isinstance(item, _WriteBatch)
                else (item.payload_bytes if isinstance(item, Message) else 0)
            )
            started = time.monotonic()
            sent_at = started
            # Book the link a chunk at a time, so the node's other lanes interleave with a
            # bulk push the way a NIC arbitrates between queue pairs, instead of waiting it out.
            remaining = num_bytes
            chunk = self._pacer.chunk_bytes()
            urgent = isinstance(item, Message) and not self.bulk
            while True:
                if self.bulk:
                    self._pacer.wait_no_urgent(timeout=1.0)
                sent_at = self._pacer.reserve(min(remaining, chunk), getattr(item, "tag", ""))
                if urgent:
                    self._pacer.urgent_booked()
                    urgent = False
                self._sleep_until(sent_at)  # the link is busy until the bytes are out
                remaining -= chunk
                if remaining <= 0:
                    break
            self.counters.add_busy(time.monotonic() - started)
            self._in_flight.put((sent_at + self._pacer.delay_s, item))

    def _deliver_loop(self) -> None:
        self._lower_if_bulk()
        peer = self._peer
        while True:
            arrival, item = self._in_flight.get()
            if item is STOP:
                self._drain(self._outbox, self._in_flight)
                return
            self._sleep_until(arrival)
            if isinstance(item, _WriteBatch):
                started = time.monotonic()
                applied = not self._closed.is_set() and peer is not None and peer._apply(item)
                self.counters.add_posting(time.monotonic() - started)  # the copy a NIC would make
                item.completion.set(applied)
            elif isinstance(item, Message):
                if peer is not None and not self._closed.is_set():
                    peer._inbox.put(item)
            elif isinstance(item, _Marker):
                item.completion.set(True)

    def _fail(self, item: object) -> None:
        if isinstance(item, (_WriteBatch, _Marker)):
            item.completion.set(False)
