"""A lane whose writes go through a one-sided transport (Mooncake, NIXL, RDMA); the rest rides a TCP side channel.

The side channel is an authenticated TCP connection with the TCP lane's frames. It carries the
transports' connection info (LANE_INFO), the owner's registered regions (REGION), two-sided
messages (MESSAGE) and the accept/revoke handshake. Writes land in the owner's memory without
its CPU, so the owner cannot drop a late write itself: the writer keeps the owner's accepted
set, `accept` and `revoke` are round trips (ACCEPT/REVOKE answered by CONFIRM), and the writer
confirms a REVOKE only when no write of that request is in flight. For the same reason ACCEPT
carries the request's slot extents, and the writer checks every descriptor against them (and
against the region) before the transport moves a byte; one outside is dropped, as on TCP.

Two threads move what is posted, in posting order: the pacing thread books the node's pacer a
chunk at a time (write bytes and message payloads alike) and hands each chunk on with its
arrival time (booked + one-way delay); the posting thread waits for that time, then writes the
chunk through the transport (synchronously) or sends the message frame. A third thread reads
the side channel.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from smartgen.lanes.base import Completion, Message, WriteOp
from smartgen.lanes.extents import ExtentMap, SlotExtents, extents_meta, parse_extents
from smartgen.lanes.framing import message_frame, recv_message
from smartgen.lanes.liveness import heartbeat_loop, lease_of
from smartgen.lanes.pacer import Pacer
from smartgen.lanes.queued import STOP, QueuedLane
from smartgen.lanes.transport import DeviceMemoryUnsupported, Segment, SourceCache, Transport, TransportError
from smartgen.lanes.wire import (
    ConnectionClosed,
    FrameType,
    hang_up,
    recv_header,
    recv_into_exact,
    send_frame,
    send_header,
)
from smartgen.lanes.write_plan import chunk_ops, region_runs

__all__ = [
    "OneSidedLane",
    "OneSidedTimeouts",
    "one_sided_factory",
    "DEFAULT_CONFIRM_TIMEOUT_S",
    "DEFAULT_WRITE_TIMEOUT_S",
]

log = logging.getLogger(__name__)
DEFAULT_CONFIRM_TIMEOUT_S = 10.0
DEFAULT_WRITE_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class OneSidedTimeouts:
    """How long a one-sided lane waits on its peer (`serve --confirm-timeout`, `--write-timeout`); past either the
    lane is broken: a writer must never guess whether the owner still takes writes, or whether a write landed."""

    confirm_s: float = DEFAULT_CONFIRM_TIMEOUT_S  # LANE_INFO answered; an ACCEPT or REVOKE confirmed
    write_s: float = DEFAULT_WRITE_TIMEOUT_S  # one write list completes (NIXL, RDMA; Mooncake's synchronous write keeps its own bound)


@dataclass(slots=True)
class _Batch:
    request_id: str
    sources: Mapping[str, torch.Tensor]
    completion: Completion
    num_chunks: int
    applied: bool = True
    tag: str = ""  # what it is, for the link's timeline


@dataclass(slots=True)
class _Chunk:
    batch: _Batch
    ops: list[WriteOp]
    last: bool


@dataclass(slots=True)
class _Marker:
    completion: Completion = field(default_factory=Completion)


class OneSidedLane(QueuedLane):
    """One endpoint: `transport` moves the writes, `sock` (already authenticated) carries everything else."""

    def __init__(
        self,
        sock: socket.socket,
        transport: Transport,
        name: str,
        pacer: Pacer | None = None,
        bulk: bool = False,
        timeouts: OneSidedTimeouts = OneSidedTimeouts(),
    ) -> None:
        super().__init__(name, pacer, bulk)
        self.transport = transport
        self.confirm_timeout_s = timeouts.confirm_s
        self.error: str | None = None
        self._sock = sock
        self._send_lock = threading.Lock()
        self._post_lock = threading.Lock()  # held while a chunk is written, so a REVOKE waits for it
        # requests the peer lets us write for -> where (its slot's byte ranges per region; None: anywhere in a region)
        self._peer_accepted: dict[str, SlotExtents | None] = {}
        self._peer_regions: dict[str, tuple[int, int, Any]] = {}  # name -> (addr, length, key)
        self._local_handles: list[Any] = []
        self._sources = SourceCache(transport)
        self._tokens = itertools.count(1)
        self._confirmed: dict[int, threading.Event] = {}
        self._in_flight: queue.Queue = queue.Queue()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._exchange_info()
        self._threads = [
            threading.Thread(target=loop, name=f"{name}-{what}", daemon=True)
            for what, loop in (("pace", self._pace_loop), ("post", self._post_loop), ("rx", self._receive_loop))
        ]
        lease = lease_of(sock)
        if lease is not None:  # heartbeats on the side channel: the transport's writes bypass it
            beats = (sock, self._send_lock, self._closed, self._on_broken, lease)
            self._threads.append(threading.Thread(target=heartbeat_loop, args=beats, name=f"{name}-hb", daemon=True))
        for thread in self._threads:
            thread.start()

    def _exchange_info(self) -> None:
        """Both ends send their transport's info first, then read the peer's (small frames: no deadlock)."""
        timeout = self._sock.gettimeout()
        self._sock.settimeout(self.confirm_timeout_s)
        try:
            send_frame(
                self._sock, FrameType.LANE_INFO, meta={"transport": self.transport.name, **self.transport.info()}
            )
            frame = recv_header(self._sock)
        finally:
            self._sock.settimeout(timeout)
        if frame.type != FrameType.LANE_INFO or frame.meta.get("transport") != self.transport.name:
            raise TransportError(
                f"peer speaks {frame.meta.get('transport', frame.type.name)}, not {self.transport.name}"
            )
        self.transport.connect(frame.meta)

    # -- the owner's side: regions and acceptance -----------------------------------------
    def register_region(self, name: str, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu" and not self.transport.registers_device_memory(buffer.device):
            raise DeviceMemoryUnsupported(
                f"the {self.transport.name} lane cannot register {buffer.device} memory here (region {name!r}): "
                "stage the pool through host memory (DecodePool(staged=True); `smartgen serve` does so by itself), "
                "or use a lane that lands in device memory (tcp; rdma with GPUDirect RDMA, see `smartgen info`)"
            )
        super().register_region(name, buffer)
        handle, key = self.transport.register(buffer)
        self._local_handles.append(handle)
        addr = self.transport.region_address(handle, buffer)
        meta = {"name": name, "addr": addr, "length": buffer.numel(), "key": key}
        self._send_control(FrameType.REGION, "", meta)

    def accept(self, request_id: str, extents: ExtentMap | None = None) -> None:
        # the writer's lane checks every descriptor against these before writing: nothing checks on this side
        super().accept(request_id, extents)
        meta = {} if extents is None else {"extents": extents_meta(extents)}
        self._round_trip(FrameType.ACCEPT, request_id, meta)

    def revoke(self, request_id: str) -> None:
        super().revoke(request_id)
        self._round_trip(FrameType.REVOKE, request_id)

    def _round_trip(self, frame_type: FrameType, request_id: str, meta: dict[str, Any] | None = None) -> None:
        token = next(self._tokens)
        event = self._confirmed[token] = threading.Event()
        try:
            self._send_control(frame_type, request_id, {**(meta or {}), "token": token})
            deadline = time.monotonic() + self.confirm_timeout_s
            while not event.wait(0.05):  # a closed lane has nothing in flight: stop waiting
                if self._closed.is_set():
                    return
                if time.monotonic() > deadline:
                    self._on_broken(f"peer did not confirm {frame_type.name} of {request_id!r}")
                    return
        finally:
            self._confirmed.pop(token, None)

    def _send_control(self, frame_type: FrameType, request_id: str, meta: dict[str, Any]) -> None:
        try:
            with self._send_lock:
                send_frame(self._sock, frame_type, request_id, meta)
        except OSError as exc:
            self._on_broken(f"side channel: {exc}")

    # -- the writer's side ----------------------------------------------------------------
    def post_writes(
        self, request_id: str, sources: Mapping[str, torch.Tensor], ops: Sequence[WriteOp], *, tag: str
    ) -> Completion:
        merged, completion, _ = self._new_batch(ops, tag)
        if completion.done():
            return completion
        chunks = chunk_ops(merged, self._pacer.chunk_bytes())
        batch = _Batch(request_id, sources, completion, len(chunks), tag=tag)
        for i, chunk in enumerate(chunks):
            self._outbox.put(_Chunk(batch, chunk, i == len(chunks) - 1))
        return completion

    def flush(self, timeout: float | None = None) -> bool:
        marker = _Marker()
        self._outbox.put(marker)
        return marker.completion.wait(timeout)

    def _pace_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is STOP:
                self._in_flight.put((0.0, STOP))
                return
            started = time.monotonic()
            due = started
            if isinstance(item, _Chunk):
                if self.bulk:
                    self._pacer.wait_no_urgent(timeout=1.0)
                due = self._pacer.reserve(sum(op.length for op in item.ops), item.batch.tag)
            elif isinstance(item, Message):
                size = self._pacer.chunk_bytes()
                remaining = item.payload_bytes
                due = self._pacer.reserve(min(remaining, size), item.tag)
                if not self.bulk:
                    self._pacer.urgent_booked()
                while (remaining := remaining - size) > 0:
                    due = self._pacer.reserve(min(remaining, size), item.tag)
            self._sleep_until(due)  # the link is busy until the bytes are out
            self.counters.add_busy(time.monotonic() - started)
            self._in_flight.put((due + self._pacer.delay_s, item))

    def _post_loop(self) -> None:
        try:
            while True:
                arrival, item = self._in_flight.get()
                if item is STOP:
                    return
                self._sleep_until(arrival)
                try:
                    self._post(item)
                except (OSError, ConnectionError) as exc:
                    self._fail(item)
                    self._on_broken(f"{self.transport.name}: {exc}")
                    return
                except Exception as exc:  # a bug must close the lane with its reason, never leave a batch hanging
                    log.exception("%s: posting failed", self.name)
                    self._fail(item)
                    self._on_broken(f"{self.transport.name}: {type(exc).__name__}: {exc}")
                    return
        finally:
            self._drain(self._outbox, self._in_flight)

    def _post(self, item: object) -> None:
        if self._closed.is_set():
            self._fail(item)
        elif isinstance(item, _Chunk):
            started = time.monotonic()
            self._write_chunk(item)
            self.counters.add_posting(time.monotonic() - started)
        elif isinstance(item, Message):
            meta, parts = message_frame(item)
            with self._send_lock:
                send_header(self._sock, FrameType.MESSAGE, item.request_id, meta, item.payload_bytes)
                for part in parts:
                    self._sock.sendall(part)
        elif isinstance(item, _Marker):
            item.completion.set(True)

    def _write_chunk(self, chunk: _Chunk) -> None:
        batch = chunk.batch
        with self._post_lock:
            if batch.applied and batch.request_id in self._peer_accepted:
                ops = self._inside_slot(batch, chunk.ops)
                try:
                    segments = [self._resolve(batch.sources, op) for op in ops]
                except (KeyError, ValueError) as exc:  # a bad descriptor fails its batch, not the lane
                    log.warning("%s: dropped a batch of %r: %s", self.name, batch.request_id, exc)
                    batch.applied = False
                else:
                    runs = [segments] if self.transport.ordered else region_runs(segments, ops)
                    for run in runs:  # each run lands whole before the next starts: data before mask
                        self.transport.write(run)
            else:
                batch.applied = False
        if chunk.last:
            batch.completion.set(batch.applied)

    def _inside_slot(self, batch: _Batch, ops: list[WriteOp]) -> list[WriteOp]:
        """The descriptors inside the request's slot; the others are dropped (and the batch reported not applied)."""
        allowed = self._peer_accepted.get(batch.request_id)
        if allowed is None:
            return ops
        inside = [op for op in ops if allowed.allows(op.dst, op.dst_offset, op.length)]
        if len(inside) < len(ops):
            log.warning(
                "%s: dropped %d write(s) of %r outside its slot", self.name, len(ops) - len(inside), batch.request_id
            )
            batch.applied = False
        return inside

    def _resolve(self, sources: Mapping[str, torch.Tensor], op: WriteOp) -> Segment:
        source = sources[op.src]
        if op.src_offset + op.length > source.numel() * source.element_size():
            raise ValueError(f"source {op.src!r} is shorter than {op.src_offset + op.length} bytes")
        region = self._peer_regions.get(op.dst)
        if region is None:
            raise KeyError(f"the peer registered no region {op.dst!r}")
        addr, length, key = region
        if op.dst_offset + op.length > length:
            raise ValueError(f"write past the end of region {op.dst!r} ({op.dst_offset}+{op.length} > {length})")
        src_key = self._sources.key_for(source)
        return Segment(source.data_ptr() + op.src_offset, addr + op.dst_offset, op.length, src_key, key)

    # -- the side channel -------------------------------------------------------------------
    def _receive_loop(self) -> None:
        try:
            while not self._closed.is_set():
                frame = recv_header(self._sock)
                if frame.type == FrameType.MESSAGE:
                    self._inbox.put(recv_message(partial(recv_into_exact, self._sock), frame))
                elif frame.type == FrameType.REGION:
                    meta = frame.meta
                    key = self.transport.peer_region(meta["key"])
                    self._peer_regions[str(meta["name"])] = (int(meta["addr"]), int(meta["length"]), key)
                elif frame.type in (FrameType.ACCEPT, FrameType.REVOKE):
                    with self._post_lock:  # a REVOKE waits for the chunk being written
                        if frame.type == FrameType.ACCEPT:
                            extents = frame.meta.get("extents")
                            allowed = None if extents is None else SlotExtents(parse_extents(extents))
                            self._peer_accepted[frame.request_id] = allowed
                        else:
                            self._peer_accepted.pop(frame.request_id, None)
                    self._send_control(FrameType.CONFIRM, frame.request_id, {"token": frame.meta["token"]})
                elif frame.type == FrameType.CONFIRM:
                    event = self._confirmed.get(int(frame.meta["token"]))
                    if event is not None:
                        event.set()
                elif frame.type == FrameType.HEARTBEAT:
                    pass  # its arrival is the point: the recv above did not time out (liveness.py)
                elif frame.type == FrameType.BYE:
                    raise ConnectionClosed("peer said goodbye")
                else:
                    raise ConnectionError(f"unexpected {frame.type.name} frame")
        except TimeoutError:
            self._on_broken("peer silent for longer than the lease: lease expired")
        except (OSError, ConnectionError, ValueError, KeyError) as exc:
            self._on_broken(f"connection lost: {exc}")
        except Exception as exc:  # a malformed frame must end this connection with a reason, not kill a thread
            self._on_broken(f"bad frame from peer: {type(exc).__name__}: {exc}")

    # -- shutdown ---------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._outbox.put(STOP)
        hang_up(self._sock, self._send_lock)
        self._inbox.put(STOP)
        for thread in self._threads:
            if (
                thread is not threading.current_thread() and thread.ident is not None
            ):  # started (a peer may hang up first)
                thread.join(timeout=5)
        # Only now, with no write of ours in flight: the peer can no longer land anything in our regions.
        self._release_registrations()
        self.transport.close()

    def _release_registrations(self) -> None:
        self._sources.clear()

    def _on_broken(self, reason: str) -> None:
        if not self._closed.is_set():
            self.error = reason
            log.info("%s: %s", self.name, reason)
            threading.Thread(target=self.close, daemon=True).start()  # close joins this very thread

    def _fail(self, item: object) -> None:
        if isinstance(item, _Chunk):
            item.batch.applied = False
            if item.last:
                item.batch.completion.set(False)
        elif isinstance(item, _Marker):
            item.completion.set(False)


def one_sided_factory(
    make_transport: Callable[[socket.socket, OneSidedTimeouts], Any],
    lane_class: Callable[..., OneSidedLane] = OneSidedLane,
) -> Callable[..., OneSidedLane]:
    """A lane factory for TcpListener/tcp_connect: a fresh `make_transport(sock, timeouts)` moves the writes, `sock`
    (authenticated) is the side channel, `lane_class` the lane made of them; the transport is closed if the lane
    does not come up."""

    def factory(
        sock: socket.socket,
        name: str,
        pacer: Pacer | None = None,
        bulk: bool = False,
        timeouts: OneSidedTimeouts = OneSidedTimeouts(),
    ) -> OneSidedLane:
        transport = make_transport(sock, timeouts)
        try:
            return lane_class(sock, transport, name, pacer, bulk, timeouts)
        except BaseException:
            transport.close()
            raise

    return factory
