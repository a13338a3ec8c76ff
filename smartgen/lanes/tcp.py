"""A lane over one TCP connection: one-sided writes land in place in registered regions, messages in order.

Two threads per endpoint: the transmit thread takes posted batches and messages in order,
books the node's pacer a chunk at a time (so a link can be capped at a given Gbit/s, and
bulk lanes yield to urgent ones between chunks) and writes them to the socket straight from
the source tensors; the receive thread reads frames and writes each WRITE's payload straight
into the destination region (`recv_into`, no intermediate buffer), acknowledges it, and
queues messages. A one-way delay is emulated from the sender's timestamp (same-host clocks).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from smartgen.lanes.base import Completion, Message, WriteOp
from smartgen.lanes.checks import check_write_ops, drain
from smartgen.lanes.framing import bytes_view, message_frame, recv_message
from smartgen.lanes.liveness import heartbeat_loop, lease_of
from smartgen.lanes.pacer import Pacer
from smartgen.lanes.queued import STOP, QueuedLane
from smartgen.lanes.vectored import recv_into_views, send_views
from smartgen.lanes.wire import (
    ConnectionClosed,
    FrameType,
    hang_up,
    header_bytes,
    recv_header,
    recv_into_exact,
    send_frame,
)

__all__ = ["TcpLane"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Batch:
    seq: int
    request_id: str
    sources: Mapping[str, torch.Tensor]
    ops: list[WriteOp]
    num_bytes: int


class TcpLane(QueuedLane):
    """One endpoint of a connected socket (both peers wrap their socket in a TcpLane)."""

    def __init__(
        self, sock: socket.socket, name: str, pacer: Pacer | None = None, bulk: bool = False, *, threads: bool = True
    ) -> None:
        super().__init__(name, pacer, bulk)
        self._sock = sock
        self._send_lock = threading.Lock()  # ACKs from the receive thread share the socket
        self._seq = 0
        self._acked = 0
        self._pending: dict[int, Completion] = {}
        self._pending_lock = threading.Condition()
        self.error: str | None = None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not threads:  # driven by hand (the fuzz tests call `_receive_loop` on a scripted socket)
            self._threads: list[threading.Thread] = []
            return
        self._threads = [
            threading.Thread(target=self._transmit_loop, name=f"{name}-tx", daemon=True),
            threading.Thread(target=self._receive_loop, name=f"{name}-rx", daemon=True),
        ]
        lease = lease_of(sock)  # an armed socket (tcp_link) carries the lease; a bare one runs without
        if lease is not None:
            beats = (sock, self._send_lock, self._closed, self._on_broken, lease)
            self._threads.append(threading.Thread(target=heartbeat_loop, args=beats, name=f"{name}-hb", daemon=True))
        for thread in self._threads:
            thread.start()

    # -- sending side ---------------------------------------------------------------
    def post_writes(
        self, request_id: str, sources: Mapping[str, torch.Tensor], ops: Sequence[WriteOp], *, tag: str
    ) -> Completion:
        merged, completion, num_bytes = self._new_batch(ops, tag)
        if completion.done():
            return completion
        with self._pending_lock:
            self._seq += 1
            seq = self._seq
            self._pending[seq] = completion
        self._outbox.put(_Batch(seq, request_id, sources, merged, num_bytes))
        return completion

    def flush(self, timeout: float | None = None) -> bool:
        with self._pending_lock:
            target = self._seq
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._pending_lock:
            while self._acked < target and not self._closed.is_set():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._pending_lock.wait(remaining)
            return self._acked >= target

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._outbox.put(STOP)
        hang_up(self._sock, self._send_lock)
        self._fail_pending()
        self._inbox.put(STOP)
        for thread in self._threads:  # let them unwind before the interpreter (or the caller) moves on
            if (
                thread is not threading.current_thread() and thread.ident is not None
            ):  # started (a peer may hang up first)
                thread.join(timeout=2)

    def _fail_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, {}
            self._pending_lock.notify_all()
        for completion in pending.values():
            completion.set(False)

    # -- threads ----------------------------------------------------------------------
    def _paced_send(self, head: bytes, parts: list[memoryview]) -> None:
        """Sends a frame's header and payload parts a chunk at a time, booking the pacer before each chunk; the parts
        of a chunk (scattered blocks) go out in one system call, the header with the first chunk."""
        for chunk in _chunks(parts, self._pacer.chunk_bytes()):
            if self.bulk:
                self._pacer.wait_no_urgent(timeout=1.0)
            due = self._pacer.reserve(sum(view.nbytes for view in chunk))
            remaining = due - time.monotonic()
            if remaining > 0:
                self._closed.wait(remaining)
            send_views(self._sock, [head, *chunk] if head else chunk)
            head = b""
        if head:  # no payload
            self._sock.sendall(head)

    def _transmit_loop(self) -> None:
        try:
            while True:
                item = self._outbox.get()
                if item is STOP:
                    return
                started = time.monotonic()
                stamp = {"t": time.time()} if self._pacer.delay_s else {}
                if isinstance(item, _Batch):
                    views = {name: bytes_view(t) for name, t in item.sources.items()}
                    parts = [views[op.src][op.src_offset : op.src_offset + op.length] for op in item.ops]
                    meta = {"seq": item.seq, "ops": [[op.dst, op.dst_offset, op.length] for op in item.ops], **stamp}
                    # The send lock covers the whole frame: ACKs from the receive thread share the socket.
                    head = header_bytes(FrameType.WRITE, item.request_id, meta, item.num_bytes)
                    with self._send_lock:
                        self._paced_send(head, parts)
                elif isinstance(item, Message):
                    self._send_message(item, stamp)
                self.counters.add_busy(time.monotonic() - started)
        except (OSError, ConnectionError) as exc:
            self._on_broken(f"send failed: {exc}")

    def _send_message(self, message: Message, stamp: dict) -> None:
        meta, parts = message_frame(message)
        urgent = not self.bulk
        try:
            head = header_bytes(FrameType.MESSAGE, message.request_id, {**meta, **stamp}, message.payload_bytes)
            with self._send_lock:
                self._paced_send(head, parts)  # a fetch reply's KV pays the link like a push does
        finally:
            if urgent:
                self._pacer.urgent_booked()

    def _receive_loop(self) -> None:
        try:
            while not self._closed.is_set():
                frame = recv_header(self._sock)
                if "t" in frame.meta and self._pacer_delay():
                    # emulated one-way delay; capped at it, so a stamp from the future cannot stall this thread
                    delay = float(frame.meta["t"]) + self._pacer_delay() - time.time()
                    if delay > 0:
                        time.sleep(min(delay, self._pacer_delay()))
                if frame.type == FrameType.WRITE:
                    self._receive_write(frame)
                elif frame.type == FrameType.MESSAGE:
                    self._receive_message(frame)
                elif frame.type == FrameType.ACK:
                    self._on_ack(int(frame.meta["seq"]), bool(frame.meta.get("applied", True)))
                elif frame.type == FrameType.HEARTBEAT:
                    pass  # its arrival is the point: the recv above did not time out
                elif frame.type == FrameType.BYE:
                    raise ConnectionClosed("peer said goodbye")
                else:
                    raise ConnectionError(f"unexpected {frame.type.name} frame")
        except TimeoutError:
            lease = lease_of(self._sock)
            self._on_broken(f"peer silent for {lease.seconds if lease else '?'} s: lease expired", protocol=True)
        except (OSError, ConnectionError) as exc:
            self._on_broken(f"connection lost: {exc}", protocol=not isinstance(exc, ConnectionClosed))
        except Exception as exc:  # a malformed frame (bad meta types, ...): this connection ends, with the reason
            self._on_broken(f"bad frame from peer: {type(exc).__name__}: {exc}", protocol=True)

    def _pacer_delay(self) -> float:
        return self._pacer.delay_s

    def _receive_write(self, frame) -> None:
        ops = check_write_ops(frame.meta, frame.payload_length)
        with self._apply_lock:
            applied = frame.request_id in self._accepted
            rows: list[memoryview] = []  # host destinations not yet read: filled by one call when the run ends
            for dst, offset, length in ops:
                region = self._target(frame.request_id, dst, offset, length)
                if region is not None and region.device.type == "cpu":
                    rows.append(bytes_view(region)[offset : offset + length])
                    continue
                recv_into_views(self._sock, rows)
                rows = []
                if region is None:  # not accepted, unknown region, or outside the request's slot: drained, dropped
                    applied = False
                    drain(self._sock, length)
                else:  # device memory: land through a host buffer
                    staging = bytearray(length)
                    recv_into_exact(self._sock, memoryview(staging))
                    region[offset : offset + length].copy_(torch.frombuffer(staging, dtype=torch.uint8))
            recv_into_views(self._sock, rows)
        with self._send_lock:
            send_frame(self._sock, FrameType.ACK, meta={"seq": frame.meta["seq"], "applied": applied})

    def _receive_message(self, frame) -> None:
        self._inbox.put(recv_message(self._sock, frame))

    def _on_ack(self, seq: int, applied: bool) -> None:
        # ACKs come in order, one per WRITE, so `applied` belongs to `seq` alone
        with self._pending_lock:
            self._acked = max(self._acked, seq)
            completion = self._pending.pop(seq, None)
            self._pending_lock.notify_all()
        if completion is not None:
            completion.set(applied)

    def _on_broken(self, reason: str, protocol: bool = False) -> None:
        if not self._closed.is_set():
            self.error = reason
            # a dead, silent or misbehaving peer is worth a warning; an orderly goodbye is not
            log.log(logging.WARNING if protocol else logging.INFO, "%s: closing: %s", self.name, reason)
            self.close()


def _chunks(parts: list[memoryview], size: int) -> list[list[memoryview]]:
    """The parts cut into chunks of at most `size` bytes each, in order (a big part spans chunks, small ones share)."""
    chunks: list[list[memoryview]] = []
    current: list[memoryview] = []
    room = size
    for part in parts:
        while part.nbytes > room:  # the part fills this chunk; its rest goes on
            current.append(part[:room])
            chunks.append(current)
            part, current, room = part[room:], [], size
        if part.nbytes:
            current.append(part)
            room -= part.nbytes
        if room == 0:
            chunks.append(current)
            current, room = [], size
    if current:
        chunks.append(current)
    return chunks
