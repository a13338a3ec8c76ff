"""Two-sided messages over SEND/RECV: MESSAGE frames cut into fragments that fit the peer's bounce buffers.

A message is the TCP lane's MESSAGE frame (header, request id, JSON meta, payload bytes). The
sender cuts the frame into SENDs of at most the peer's bounce-buffer size; RC delivers them in
order into the peer's posted RECVs, and the receiver joins them again (`FrameAssembler`). Frames
are self-delimiting, so fragments need no header of their own.
"""

from __future__ import annotations

from collections.abc import Iterator

from smartgen.lanes.base import Message
from smartgen.lanes.framing import message_frame, recv_message
from smartgen.lanes.wire import HEADER, MAX_META, Frame, FrameType, decode_frame, header_bytes, parse_header

__all__ = ["frame_parts", "FrameAssembler", "fragments"]


def frame_parts(message: Message) -> list[memoryview]:
    """The bytes of `message`'s MESSAGE frame, header first (no copy of the payload)."""
    meta, parts = message_frame(message)
    head = header_bytes(FrameType.MESSAGE, message.request_id, meta, sum(p.nbytes for p in parts))
    return [memoryview(head), *parts]


def fragments(total: int, size: int) -> list[int]:
    """The SEND sizes for `total` bytes cut at `size`."""
    if size < 1:
        raise ValueError("fragment size must be positive")
    return [min(size, total - start) for start in range(0, total, size)]


class FrameAssembler:
    """Joins received fragments and hands out each message once its frame is whole."""

    def __init__(self, max_meta: int = MAX_META) -> None:
        self._buffer = bytearray()
        self._max_meta = max_meta

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes | memoryview) -> Iterator[Message]:
        """Messages completed by `data`; ConnectionError for a frame that is not a well-formed MESSAGE."""
        self._buffer += data
        while len(self._buffer) >= HEADER.size:
            kind, rid_length, meta_length, payload_length = parse_header(
                bytes(self._buffer[: HEADER.size]), self._max_meta
            )
            if kind != FrameType.MESSAGE:
                raise ConnectionError(f"a {kind.name} frame among the messages of a SEND/RECV queue pair")
            end = HEADER.size + rid_length + meta_length + payload_length
            if len(self._buffer) < end:
                return
            view = memoryview(self._buffer)
            start = HEADER.size
            rid = bytes(view[start : start + rid_length])
            meta = bytes(view[start + rid_length : start + rid_length + meta_length])
            frame = decode_frame(kind, rid, meta, payload_length)
            payload = bytes(view[end - payload_length : end])
            view.release()
            del self._buffer[:end]
            yield _message(frame, memoryview(payload))


def _message(frame: Frame, payload: memoryview) -> Message:
    position = 0

    def read_into(view: memoryview) -> None:
        nonlocal position
        size = view.nbytes
        view.cast("B")[:] = payload[position : position + size]
        position += size

    return recv_message(read_into, frame)
