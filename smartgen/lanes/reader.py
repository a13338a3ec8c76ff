"""Buffered frame reading for a lane's receive thread: one recv brings a header, request id and meta, often more.

Read exactly, a small WRITE costs three receive calls (header, request id, meta) and one for its
payload. Here the receive thread reads into a preallocated buffer as much as the socket has (up
to `BUFFER_BYTES`), so one call usually brings the whole frame, and under a stream of small
frames several of them. Payload bytes already in the buffer are copied to their destination;
what is still on the wire goes straight into the destination (`recv_into`/`recvmsg_into`), so a
large payload is never staged beyond what one buffer fill brought. `before_wait` runs before
every socket read: the lane sends its pending (coalesced) ACK there, never while frames that
are already here wait to be applied.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

from smartgen.lanes.vectored import recv_into_views
from smartgen.lanes.wire import HEADER, MAX_META, ConnectionClosed, Frame, decode_frame, parse_header

__all__ = ["FrameReader", "BUFFER_BYTES"]

BUFFER_BYTES = 64 * 1024
# A rest of a payload up to this size is read through the buffer (one call may bring the next frames too);
# a larger one goes straight into its destination.
STAGED_BYTES = 16 * 1024


class FrameReader:
    """Reads frames and payloads from one socket; the only reader of that socket once created."""

    def __init__(
        self, sock: socket.socket, before_wait: Callable[[], None] | None = None, size: int = BUFFER_BYTES
    ) -> None:
        self._sock = sock
        self._buffer = memoryview(bytearray(size))
        self._start = 0  # first unread byte in the buffer
        self._end = 0  # end of the bytes received into it
        self._before_wait = before_wait

    @property
    def buffered(self) -> int:
        """Bytes received and not yet read (0: the next read waits on the socket)."""
        return self._end - self._start

    def read_frame(self, max_meta: int = MAX_META) -> Frame:
        """The next frame's header, request id and meta (checked as `wire.recv_header` checks them)."""
        kind, rid_length, meta_length, payload_length = parse_header(self._take(HEADER.size), max_meta)
        rid = self._read_bytes(rid_length) if rid_length else b""
        meta = self._read_bytes(meta_length) if meta_length else b""
        return decode_frame(kind, rid, meta, payload_length)

    def read_into(self, view: memoryview) -> None:
        """Fills `view` with the next bytes of the stream."""
        self.read_into_views([view])

    def read_into_views(self, views: Sequence[memoryview]) -> None:
        """Fills every view, in order, with the next bytes: from the buffer first, then from the socket."""
        rest: Sequence[memoryview] = ()
        # a scattered WRITE has thousands of rows: the copies out of the buffer are inlined, and no row costs
        # anything past the buffer
        buffer, start, end = self._buffer, self._start, self._end
        for i, view in enumerate(views):
            size = view.nbytes
            if end - start >= size:
                view[:] = buffer[start : start + size]
                start += size
                continue
            self._start = start
            got = self._copy_out(view)
            rest = [view[got:], *views[i + 1 :]] if got else views[i:]
            break
        else:
            self._start = start
            return
        if sum(view.nbytes for view in rest) <= STAGED_BYTES:
            for view in rest:
                while view.nbytes:
                    self._fill(1)
                    view = view[self._copy_out(view) :]
            return
        self._wait()
        recv_into_views(self._sock, rest)

    def skip(self, length: int) -> None:
        """Reads and drops the next `length` bytes (a refused write's payload), a buffer at a time."""
        while length:
            self._fill(1)
            step = min(length, self.buffered)
            self._start += step
            length -= step

    # -- the buffer ---------------------------------------------------------------------
    def _copy_out(self, view: memoryview) -> int:
        size = min(view.nbytes, self.buffered)
        if size:
            view[:size] = self._buffer[self._start : self._start + size]
            self._start += size
        return size

    def _take(self, size: int) -> memoryview:
        """The next `size` (at most the buffer's) bytes, valid until the next read."""
        self._fill(size)
        view = self._buffer[self._start : self._start + size]
        self._start += size
        return view

    def _read_bytes(self, size: int) -> bytes:
        if size <= len(self._buffer):
            return bytes(self._take(size))
        out = bytearray(size)  # a meta bigger than the buffer (a huge descriptor list): its own allocation
        self.read_into(memoryview(out))
        return bytes(out)

    def _fill(self, size: int) -> None:
        """Makes at least `size` unread bytes available, reading as much as the socket has each time."""
        if self.buffered >= size:
            return
        if self._start + size > len(self._buffer):  # no room behind the unread bytes: move them to the front
            unread = self.buffered
            self._buffer[:unread] = self._buffer[self._start : self._end]
            self._start, self._end = 0, unread
        while self.buffered < size:
            self._wait()
            received = self._sock.recv_into(self._buffer[self._end :])
            if received == 0:
                raise ConnectionClosed("peer closed the connection")
            self._end += received

    def _wait(self) -> None:
        if self.buffered == 0:
            self._start = self._end = 0  # an empty buffer starts over: whole frames fit again
        if self._before_wait is not None:
            self._before_wait()
