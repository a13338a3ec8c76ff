"""A lane over one TCP connection: one-sided writes land in place in registered regions, messages in order.

Two threads per endpoint: the transmit thread takes posted batches and messages in order
(WRITEs queued behind each other go out together, one system call), books the node's pacer a
chunk at a time (so a link can be capped at a given Gbit/s, and bulk lanes yield to urgent ones
between chunks) and writes them to the socket straight from the source tensors; the receive
thread reads frames through a buffer (`reader.py`: one call for header, id and meta), writes each
WRITE's payload into the destination region (large ones straight from the socket), acknowledges
the WRITEs it has applied with one ACK before it next waits on the socket, and queues messages.
A one-way delay is emulated from the sender's timestamp (same-host clocks).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from smartgen.lanes.base import Completion, Message, WriteOp
from smartgen.lanes.checks import check_ack, check_write
from smartgen.lanes.framing import bytes_view, message_frame, recv_message
from smartgen.lanes.liveness import arm_in_kernel, heartbeat_loop, lease_of
from smartgen.lanes.pacer import Pacer
from smartgen.lanes.queued import STOP, QueuedLane
from smartgen.lanes.reader import FrameReader
from smartgen.lanes.row_table import RowTable, encode_table
from smartgen.lanes.scatter import copy_rows, phases, worth_gathering
from smartgen.lanes.vectored import send_views
from smartgen.lanes.wire import ConnectionClosed, FrameType, hang_up, header_bytes, send_frame

__all__ = ["TcpLane"]

log = logging.getLogger(__name__)

MAX_GATHERED = 64  # queued WRITE frames sent together (a sendmsg takes up to 512 buffers)


@dataclass(slots=True)
class _Batch:
    seq: int
    request_id: str
    sources: Mapping[str, torch.Tensor]
    ops: list[WriteOp]
    num_bytes: int
    tag: str = ""  # what it is, for the link's timeline (a gathered run of batches books as its first's)


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
        self._lease = lease_of(sock)  # an armed socket (tcp_link) carries the lease; a bare one runs without
        self._reader = FrameReader(sock, self._send_ack)
        self._unacked: int | None = None  # the last WRITE applied or dropped and not yet acknowledged
        self._dropped: list[int] = []  # which of the unacknowledged WRITEs were not applied
        self._region_views: dict[str, tuple[torch.Tensor, memoryview]] = {}
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not threads:  # driven by hand (the fuzz tests call `_receive_loop` on a scripted socket)
            self._threads: list[threading.Thread] = []
            return
        self._threads = [
            threading.Thread(target=self._transmit_loop, name=f"{name}-tx", daemon=True),
            threading.Thread(target=self._receive_loop, name=f"{name}-rx", daemon=True),
        ]
        if self._lease is not None:
            arm_in_kernel(sock, self._lease)
            beats = (sock, self._send_lock, self._closed, self._on_broken, self._lease)
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
        self._outbox.put(_Batch(seq, request_id, sources, merged, num_bytes, tag))
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
    def _paced_send(self, parts: list[memoryview], tag: str = "") -> float:
        """Sends frames (headers and payload parts, in order) a chunk at a time, booking the pacer before each chunk;
        the parts of a chunk (headers, scattered blocks, several small frames) go out in one system call. Returns
        the seconds spent in those calls (the pacer's waits left out)."""
        sending = 0.0
        for chunk in _chunks(parts, self._pacer.chunk_bytes()):
            if self.bulk:
                self._pacer.wait_no_urgent(timeout=1.0)
            due = self._pacer.reserve(sum(view.nbytes for view in chunk), tag)
            remaining = due - time.monotonic()
            if remaining > 0:
                self._closed.wait(remaining)
            started = time.monotonic()
            send_views(self._sock, chunk)
            sending += time.monotonic() - started
        return sending

    def _transmit_loop(self) -> None:
        self._lower_if_bulk()
        held: object = None  # an item taken off the outbox while gathering WRITEs, sent next
        try:
            while True:
                item, held = (held, None) if held is not None else (self._outbox.get(), None)
                if item is STOP:
                    return
                started = time.monotonic()
                stamp = {"t": time.time()} if self._pacer.delay_s else {}
                if isinstance(item, _Batch):
                    batches, held = self._gather(item)
                    parts = self._write_frames(batches, stamp)
                    framing = time.monotonic() - started
                    # The send lock covers whole frames: ACKs from the receive thread share the socket.
                    with self._send_lock:
                        self.counters.add_posting(framing + self._paced_send(parts, item.tag))
                elif isinstance(item, Message):
                    self._send_message(item, stamp)
                self.counters.add_busy(time.monotonic() - started)
        except BlockingIOError:  # the kernel's send timeout (liveness.arm_in_kernel)
            self._on_broken(f"send failed: the peer did not drain for {self._lease.seconds if self._lease else '?'} s")
        except (OSError, ConnectionError) as exc:
            self._on_broken(f"send failed: {exc}")

    def _gather(self, first: _Batch) -> tuple[list[_Batch], object]:
        """`first` and the WRITEs of its tag queued right behind it, up to a chunk of bytes: one system call sends
        them all. Returns them and the item that ended the run (a message, STOP, a WRITE of another tag), or None. A
        run keeps to one tag so that the link's timeline books each path's bytes under its own."""
        batches = [first]
        room = self._pacer.chunk_bytes() - first.num_bytes
        while room > 0 and len(batches) < MAX_GATHERED:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return batches, None
            if not isinstance(item, _Batch) or item.tag != first.tag:
                return batches, item
            batches.append(item)
            room -= item.num_bytes
        return batches, None

    @staticmethod
    def _write_frames(batches: list[_Batch], stamp: dict) -> list[memoryview]:
        """The WRITE frames of `batches`, header then payload each: rows straight from the source tensors, or, for
        many small rows, gathered into one buffer with their descriptors as a table (`_gathered_frame`)."""
        cache: dict[int, memoryview] = {}  # per source tensor; the batches hold the tensors alive meanwhile
        parts: list[memoryview] = []
        for batch in batches:
            gathered = _gathered_frame(batch, stamp)
            if gathered is not None:
                parts += gathered
                continue
            meta = {"seq": batch.seq, "ops": [[op.dst, op.dst_offset, op.length] for op in batch.ops], **stamp}
            parts.append(memoryview(header_bytes(FrameType.WRITE, batch.request_id, meta, batch.num_bytes)))
            views = {name: _cached_view(cache, tensor) for name, tensor in batch.sources.items()}
            parts += [views[op.src][op.src_offset : op.src_offset + op.length] for op in batch.ops]
        return parts

    def _send_message(self, message: Message, stamp: dict) -> None:
        meta, parts = message_frame(message)
        urgent = not self.bulk
        try:
            head = header_bytes(FrameType.MESSAGE, message.request_id, {**meta, **stamp}, message.payload_bytes)
            with self._send_lock:
                # a fetch reply's KV pays the link like a push does
                self._paced_send([memoryview(head), *parts], message.tag)
        finally:
            if urgent:
                self._pacer.urgent_booked()

    def _receive_loop(self) -> None:
        self._lower_if_bulk()
        try:
            while not self._closed.is_set():
                frame = self._reader.read_frame()
                if "t" in frame.meta and self._pacer_delay():
                    # emulated one-way delay; capped at it, so a stamp from the future cannot stall this thread
                    delay = float(frame.meta["t"]) + self._pacer_delay() - time.time()
                    if delay > 0:
                        self._send_ack()  # what already landed is not held back by the next frame's delay
                        time.sleep(min(delay, self._pacer_delay()))
                if frame.type == FrameType.WRITE:
                    self._receive_write(frame)
                elif frame.type == FrameType.MESSAGE:
                    self._receive_message(frame)
                elif frame.type == FrameType.ACK:
                    self._on_ack(frame.meta)
                elif frame.type == FrameType.HEARTBEAT:
                    pass  # its arrival is the point: the recv above did not time out
                elif frame.type == FrameType.BYE:
                    raise ConnectionClosed("peer said goodbye")
                else:
                    raise ConnectionError(f"unexpected {frame.type.name} frame")
        except (TimeoutError, BlockingIOError):  # Python's timeout, or the kernel's (liveness.arm_in_kernel)
            lease = self._lease
            self._on_broken(f"peer silent for {lease.seconds if lease else '?'} s: lease expired", protocol=True)
        except (OSError, ConnectionError) as exc:
            self._on_broken(f"connection lost: {exc}", protocol=not isinstance(exc, ConnectionClosed))
        except Exception as exc:  # a malformed frame (bad meta types, ...): this connection ends, with the reason
            self._on_broken(f"bad frame from peer: {type(exc).__name__}: {exc}", protocol=True)

    def _pacer_delay(self) -> float:
        return self._pacer.delay_s

    def _receive_write(self, frame) -> None:
        checked = check_write(frame.meta, frame.payload_length)
        table = checked if isinstance(checked, RowTable) else None
        if not isinstance(checked, RowTable) and worth_gathering(len(checked), frame.payload_length):
            table = RowTable.from_ops(checked)
        with self._apply_lock:
            applied = None if table is None else self._land_gathered(frame.request_id, table, frame.payload_length)
            if applied is None:  # row by row: the list as sent, or the table's rows
                applied = self._land_rows(
                    frame.request_id, checked.as_ops() if isinstance(checked, RowTable) else checked
                )
        # Acknowledged when this thread would next wait on the socket (the reader's `before_wait`): WRITEs that
        # arrived together share one ACK.
        self._unacked = frame.meta["seq"]
        if not applied:
            self._dropped.append(frame.meta["seq"])

    def _land_rows(self, request_id: str, ops: list[tuple[str, int, int]]) -> bool:
        """Lands a WRITE's payload row by row, host rows straight from the socket; False when any row was dropped.
        Call with the apply lock held."""
        reader = self._reader
        accepted = applied = request_id in self._accepted
        allowed = self._accepted.get(request_id)
        # per region this frame names: its host byte view, or None (not accepted, unknown, device memory);
        # a descriptor then costs a bounds check and a bisect, not a region lookup (thousands a frame)
        views: dict[str, memoryview | None] = {}
        rows: list[memoryview] = []  # host destinations not yet read: filled by one call when the run ends
        for dst, offset, length in ops:
            if dst in views:
                view = views[dst]
            else:
                region = self._regions.get(dst) if accepted else None
                on_host = region is not None and region.device.type == "cpu"
                view = views[dst] = self._host_view(dst, region) if region is not None and on_host else None
            if (
                view is not None
                and offset + length <= len(view)
                and (allowed is None or allowed.allows(dst, offset, length))
            ):
                rows.append(view[offset : offset + length])
                continue
            region = self._target(request_id, dst, offset, length)  # refused, or device memory
            reader.read_into_views(rows)
            rows = []
            if region is None:  # not accepted, unknown region, or outside the request's slot: drained, dropped
                applied = False
                reader.skip(length)
            else:  # device memory: land through a host buffer
                staging = bytearray(length)
                reader.read_into(memoryview(staging))
                region[offset : offset + length].copy_(torch.frombuffer(staging, dtype=torch.uint8))
        reader.read_into_views(rows)
        return applied

    def _land_gathered(self, request_id: str, table: RowTable, payload_bytes: int) -> bool | None:
        """Lands a WRITE of many small rows from one staging read by strided copies (`scatter`); False when any row
        was dropped (outside its region or the request's extents), None when this path does not apply (few or
        large rows, a request not accepted, a region unknown or in device memory). Call with the apply lock held."""
        if request_id not in self._accepted or not worth_gathering(len(table), payload_bytes):
            return None
        flats = []
        for name in table.names:
            region = self._regions.get(name)
            if region is None or region.device.type != "cpu":
                return None
            flats.append(np.frombuffer(self._host_view(name, region), dtype=np.uint8))
        staging = np.empty(payload_bytes, dtype=np.uint8)
        self._reader.read_into(memoryview(staging))  # type: ignore[arg-type]  # numpy: __buffer__ from 3.12
        codes, offset, length = table.codes, table.offsets, table.lengths
        start = np.cumsum(length) - length  # each row's place in the payload
        ok = offset + length <= np.array([len(flat) for flat in flats], dtype=np.int64)[codes]
        allowed = self._accepted[request_id]
        if allowed is not None:
            for code, name in enumerate(table.names):
                mine = codes == code
                ok[mine] &= allowed.allows_many(name, offset[mine], length[mine])
        for first, stop in phases(codes):
            for code in np.unique(codes[first:stop]).tolist():
                mine = (codes[first:stop] == code) & ok[first:stop]
                dst, size, src = offset[first:stop][mine], length[first:stop][mine], start[first:stop][mine]
                if len(dst):  # a peer's rows may share bytes: those land in order
                    copy_rows(flats[code], dst, staging, src, size, may_overlap=True)
        return bool(ok.all())

    def _host_view(self, name: str, region: torch.Tensor) -> memoryview:
        """A host region's byte view, made once per registration (making one costs more than landing 4 KiB)."""
        cached = self._region_views.get(name)
        if cached is None or cached[0] is not region:
            cached = self._region_views[name] = (region, bytes_view(region))
        return cached[1]

    def _send_ack(self) -> None:
        """Acknowledges every WRITE applied or dropped since the last ACK, in one frame."""
        if self._unacked is None:
            return
        meta = {"seq": self._unacked, "dropped": self._dropped}
        self._unacked, self._dropped = None, []
        with self._send_lock:
            send_frame(self._sock, FrameType.ACK, meta=meta)

    def _receive_message(self, frame) -> None:
        self._inbox.put(recv_message(self._reader.read_into, frame))

    def _on_ack(self, meta: dict) -> None:
        """Completes, in order and once each, every batch up to the ACK's `seq`; those in `dropped` as not applied."""
        seq, dropped = check_ack(meta)
        with self._pending_lock:
            if seq > self._seq:
                raise ConnectionError(f"ACK for WRITE {seq}, only {self._seq} sent")
            done = [(s, self._pending.pop(s, None)) for s in range(self._acked + 1, seq + 1)]
            self._acked = max(self._acked, seq)
            self._pending_lock.notify_all()
        for s, completion in done:
            if completion is not None:
                completion.set(s not in dropped)

    def _on_broken(self, reason: str, protocol: bool = False) -> None:
        if not self._closed.is_set():
            self.error = reason
            # a dead, silent or misbehaving peer is worth a warning; an orderly goodbye is not
            log.log(logging.WARNING if protocol else logging.INFO, "%s: closing: %s", self.name, reason)
            self.close()


def _gathered_frame(batch: _Batch, stamp: dict) -> list[memoryview] | None:
    """A WRITE of many small rows as [header, payload]: the rows gathered by strided copies into one buffer (one
    part for the socket and the pacer, not one each), the descriptors as a `row_table`. None when the batch has few
    or large rows, or a source off the host."""
    ops = batch.ops
    if not worth_gathering(len(ops), batch.num_bytes) or any(t.device.type != "cpu" for t in batch.sources.values()):
        return None
    sources = list(batch.sources)
    source_of = {name: i for i, name in enumerate(sources)}
    regions = list(dict.fromkeys(op.dst for op in ops))
    region_of = {name: i for i, name in enumerate(regions)}
    columns = np.array(
        [(source_of[op.src], op.src_offset, region_of[op.dst], op.dst_offset, op.length) for op in ops], dtype=np.int64
    )
    src_codes, src_offsets, codes, offsets, lengths = (np.ascontiguousarray(columns[:, i]) for i in range(5))
    payload = np.empty(batch.num_bytes, dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    for code in np.unique(src_codes).tolist():
        mine = src_codes == code
        flat = np.frombuffer(bytes_view(batch.sources[sources[code]]), dtype=np.uint8)
        copy_rows(payload, starts[mine], flat, src_offsets[mine], lengths[mine])
    meta = {"seq": batch.seq, "table": encode_table(regions, codes, offsets, lengths), **stamp}
    header = memoryview(header_bytes(FrameType.WRITE, batch.request_id, meta, batch.num_bytes))
    return [header, memoryview(payload)]  # type: ignore[arg-type]  # numpy: __buffer__ from Python 3.12


def _cached_view(cache: dict[int, memoryview], tensor: torch.Tensor) -> memoryview:
    view = cache.get(id(tensor))
    if view is None:
        view = cache[id(tensor)] = bytes_view(tensor)
    return view


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
