"""The lane contract: one-sided writes into registered regions plus two-sided messages, in order.

Every backend (in-process, TCP, RDMA, Mooncake) is an endpoint pair with this shape:

- the receiving side registers named memory regions (the decode pool's K, V and masks);
- the sending side posts batches of write descriptors (source region, offset → destination
  region, offset, length) that the peer applies in posting order — so a block's mask write
  posted after its data write can never be seen before the data ("data before mask");
- either side sends small messages (open, first token, fetch, idle notice, release, abort),
  ordered with the writes posted on the same endpoint;
- writes carry a request id, and the receiver applies them only while that request is
  accepted: after `revoke(request_id)` returns, no late write can land in a reused slot.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

__all__ = ["WriteOp", "coalesce", "MessageKind", "Message", "Landing", "Completion", "LaneCounters", "Lane"]


@dataclass(frozen=True, slots=True)
class WriteOp:
    """One one-sided write descriptor: `length` bytes from src[src_offset] to dst[dst_offset]."""

    src: str
    dst: str
    src_offset: int
    dst_offset: int
    length: int

    def __post_init__(self) -> None:
        if self.length <= 0 or self.src_offset < 0 or self.dst_offset < 0:
            raise ValueError(f"bad write descriptor {self}")


def coalesce(ops: Sequence[WriteOp]) -> list[WriteOp]:
    """Merges consecutive descriptors that continue each other in both source and destination.

    Order is kept (it carries the data-before-mask guarantee); only neighbours merge.
    """
    merged: list[WriteOp] = []
    for op in ops:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.src == op.src
            and last.dst == op.dst
            and last.src_offset + last.length == op.src_offset
            and last.dst_offset + last.length == op.dst_offset
        ):
            merged[-1] = WriteOp(op.src, op.dst, last.src_offset, last.dst_offset, last.length + op.length)
        else:
            merged.append(op)
    return merged


class MessageKind(IntEnum):
    """Two-sided messages between a decode node and a prefill node."""

    OPEN = 1  # decode -> prefill: a request, its pool slot and length
    FIRST_TOKEN = 2  # prefill -> decode: prefill done, the first token
    FETCH = 3  # decode -> prefill: send these tokens of this layer now
    FETCH_REPLY = 4  # prefill -> decode: their K and V
    IDLE = 5  # decode -> prefill: my link is idle, push the next speculative slice
    RELEASE = 6  # decode -> prefill: every block is local (or the request ended): free it
    ABORT = 7  # either way: the request failed; free everything
    ERROR = 8  # prefill -> decode: a request-level failure with a reason
    METADATA = 9  # prefill -> decode: one layer's selector metadata, as soon as that layer is prefilled
    FORECAST = 10  # prefill -> decode: the first decode step's query per layer, computed on the prefill node
    ATTEND = 11  # decode -> prefill: attend to these entries of this layer with this query, now
    ATTEND_REPLY = 12  # prefill -> decode: that attention's output and its softmax's max and sum


@dataclass(slots=True)
class Message:
    """A two-sided message; `payload` tensors travel as raw bytes and count toward pacing."""

    kind: MessageKind
    request_id: str
    meta: dict[str, Any] = field(default_factory=dict)
    payload: dict[str, torch.Tensor] = field(default_factory=dict)
    # the sender's queue only, never on the wire: a lane sends a message of a higher number after every queued
    # one of a lower (0, the default, in order): a forecast's fetch replies wait behind running requests' fetches
    priority: int = 0
    # the sender's only, never on the wire: what the message is, for its link's timeline (set by the lane's `send`)
    tag: str = ""

    @property
    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.payload.values())


@dataclass(frozen=True, slots=True)
class Landing:
    """Where the reply to a message belongs: its payload's bytes, in order, fill these byte ranges of host regions
    ((flat uint8 region, offset, length) each). A lane that can (RDMA) lands the reply there in place and delivers
    it with meta["landed"] (bytes landed) and no payload; every other lane delivers the payload as usual."""

    request_id: str
    ranges: Sequence[tuple[torch.Tensor, int, int]]

    @property
    def num_bytes(self) -> int:
        return sum(length for _, _, length in self.ranges)


class Completion:
    """Set when every operation of one posted batch has been applied at the peer (or dropped)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[bool], None]] = []
        self.applied = False

    def set(self, applied: bool) -> None:
        with self._lock:
            self.applied = applied
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(applied)

    def add_done_callback(self, callback: Callable[[bool], None]) -> None:
        """Calls `callback(applied)` once the batch is done (at once if it already is), on the setter's thread."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self.applied)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


class LaneCounters:
    """Bytes, descriptors and messages one endpoint sent, by tag (path), and its busy time.

    busy_seconds: the sending thread's time on each item, pacer waits included (how long the link was taken);
    posting_seconds: the lane's own work moving WRITE batches (framing and send calls, the transport's writes, the
    copy into the peer's memory), pacer waits excluded: what the descriptors themselves cost.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_by_tag: dict[str, int] = defaultdict(int)
        self.num_descriptors = 0
        self.num_batches = 0
        self.num_messages = 0
        self.busy_seconds = 0.0
        self.posting_seconds = 0.0

    def add_batch(self, tag: str, num_bytes: int, num_descriptors: int) -> None:
        with self._lock:
            self.bytes_by_tag[tag] += num_bytes
            self.num_descriptors += num_descriptors
            self.num_batches += 1

    def add_message(self, tag: str, num_bytes: int) -> None:
        with self._lock:
            self.bytes_by_tag[tag] += num_bytes
            self.num_messages += 1

    def add_busy(self, seconds: float) -> None:
        with self._lock:
            self.busy_seconds += seconds

    def add_posting(self, seconds: float) -> None:
        with self._lock:
            self.posting_seconds += seconds

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return sum(self.bytes_by_tag.values())

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "bytes_by_tag": dict(self.bytes_by_tag),
                "bytes_sent": sum(self.bytes_by_tag.values()),
                "num_descriptors": self.num_descriptors,
                "num_batches": self.num_batches,
                "num_messages": self.num_messages,
                "busy_seconds": self.busy_seconds,
                "posting_seconds": self.posting_seconds,
            }


class Lane(ABC):
    """One endpoint of a connection between a prefill node and a decode node."""

    name: str
    counters: LaneCounters
    lands_replies: bool = False  # True: `send` uses a landing to put the reply in place (RDMA)

    @abstractmethod
    def register_region(self, name: str, buffer: torch.Tensor) -> None:
        """Exposes a flat uint8 buffer to the peer's one-sided writes."""

    @abstractmethod
    def accept(self, request_id: str, extents: Mapping[str, Sequence[tuple[int, int]]] | None = None) -> None:
        """Lets writes for this request land in the registered regions: only inside `extents` (region ->
        byte ranges, the request's slot) when given; a write outside them is dropped, not applied."""

    @abstractmethod
    def revoke(self, request_id: str) -> None:
        """Stops writes for this request from landing; once it returns, none will."""

    @abstractmethod
    def post_writes(
        self, request_id: str, sources: Mapping[str, torch.Tensor], ops: Sequence[WriteOp], *, tag: str
    ) -> Completion:
        """Queues one doorbell batch of writes (coalesced); returns at once."""

    @abstractmethod
    def send(self, message: Message, *, tag: str = "control", landing: Landing | None = None) -> None:
        """Queues a message behind everything posted before it on this endpoint; `landing`: where its reply may
        land in place (a hint: lanes that cannot ignore it)."""

    def drop_landings(self, request_id: str) -> None:
        """No reply lands in place for this request once this returns (its memory is about to be reused)."""
        return None  # lanes that never land replies in place have nothing to stop

    @abstractmethod
    def recv(self, timeout: float | None = None) -> Message | None:
        """The next message from the peer, or None after `timeout` seconds (or once closed)."""

    @abstractmethod
    def flush(self, timeout: float | None = None) -> bool:
        """Waits until everything posted so far has been applied at the peer."""

    @abstractmethod
    def close(self) -> None:
        """Stops the endpoint; pending operations are dropped and waiters released."""
