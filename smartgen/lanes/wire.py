"""The TCP wire format: fixed-header frames, and the authenticated handshake that opens a connection.

Every frame is an 18-byte little-endian header, then the request id, a JSON meta block and
a raw payload:

    magic "SG" | version u8 | type u8 | request-id length u16 | meta length u32 | payload length u64

See docs/protocol.md for the frame types and the handshake.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

__all__ = [
    "PROTOCOL_VERSION",
    "FrameType",
    "Frame",
    "HEADER",
    "HandshakeError",
    "ConnectionClosed",
    "recv_exact",
    "recv_into_exact",
    "send_header",
    "header_bytes",
    "send_frame",
    "recv_header",
    "parse_header",
    "decode_frame",
    "hang_up",
    "MAX_META",
    "MAX_HANDSHAKE_META",
    "MAX_REQUEST_ID",
]

# 2: mutual authentication, heartbeats; 3: an ACK acknowledges every WRITE up to its seq; 4: IDLE hints name
# (token, head) entries, not tokens; 5: a WRITE of many small rows may carry them as a table (`row_table`)
PROTOCOL_VERSION = 5
MAGIC = b"SG"
HEADER = struct.Struct("<2sBBHIQ")
# Caps checked on the header, before a byte of the frame is allocated: above them is a protocol error.
MAX_META = 16 * 2**20  # a WRITE's descriptor list for a big layer is ~1 MiB; 16 leaves room
MAX_HANDSHAKE_META = 64 * 2**10  # before authentication a peer gets no more than this
MAX_REQUEST_ID = 256


class FrameType(IntEnum):
    CHALLENGE = 1  # server -> client: nonce, server's version
    HELLO = 2  # client -> server: version, HMAC of the nonce, model fingerprint, layout, channel
    WELCOME = 3  # server -> client: accepted
    REJECT = 4  # server -> client: refused, with the reason
    WRITE = 5  # one-sided writes: meta {"seq", "ops": [[dst, offset, length], ...]} or {"seq", "table"}, payload = their bytes
    ACK = 6  # receiver -> sender: every WRITE up to meta["seq"] is done; meta["dropped"]: those not applied
    MESSAGE = 7  # a two-sided message: meta {"kind", "meta", "payload": [[name, dtype, shape], ...]}, payload
    FLUSH = 8  # sender -> receiver: answer with ACK once everything before this is applied
    BYE = 9  # orderly close
    # one-sided lanes (Mooncake, NIXL, RDMA): the bytes move through the transport, this socket is the side channel
    LANE_INFO = 10  # both ways, once: how to reach this endpoint's transport (session, agent metadata, QP)
    REGION = 11  # owner -> writer: a registered region, meta {"name", "addr", "length", "key"}
    ACCEPT = 12  # owner -> writer: meta {"token"}; the writer may now write for this request
    REVOKE = 13  # owner -> writer: meta {"token"}; the writer stops writing for this request
    CONFIRM = 14  # writer -> owner: meta {"token"}; the ACCEPT/REVOKE is in force (nothing in flight for a REVOKE)
    HEARTBEAT = 15  # both ways, when idle: "still here" (see liveness.py)


class HandshakeError(RuntimeError):
    """The peer refused the connection, or we refused it; the message says which check failed."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection."""


@dataclass(slots=True)
class Frame:
    type: FrameType
    request_id: str
    meta: dict[str, Any]
    payload_length: int


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from the socket; bytes land straight in the caller's memory."""
    while view.nbytes:
        received = sock.recv_into(view)
        if received == 0:
            raise ConnectionClosed("peer closed the connection")
        view = view[received:]


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    recv_into_exact(sock, memoryview(buffer))
    return bytes(buffer)


def send_header(
    sock: socket.socket, frame_type: FrameType, request_id: str, meta: dict[str, Any] | None, payload_length: int
) -> None:
    """Sends a frame's header, request id and meta; `payload_length` bytes must follow."""
    sock.sendall(header_bytes(frame_type, request_id, meta, payload_length))


def header_bytes(frame_type: FrameType, request_id: str, meta: dict[str, Any] | None, payload_length: int) -> bytes:
    """A frame's header, request id and meta, as sent before its `payload_length` payload bytes."""
    rid = request_id.encode()
    meta_bytes = json.dumps(meta or {}, separators=(",", ":")).encode()
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(frame_type), len(rid), len(meta_bytes), payload_length)
    return header + rid + meta_bytes


def send_frame(
    sock: socket.socket,
    frame_type: FrameType,
    request_id: str = "",
    meta: dict[str, Any] | None = None,
    payload: list[memoryview] | None = None,
) -> None:
    """Sends one whole frame; payload parts go out as they are (no copy)."""
    parts = payload or []
    send_header(sock, frame_type, request_id, meta, sum(part.nbytes for part in parts))
    for part in parts:
        sock.sendall(part)


def recv_header(sock: socket.socket, max_meta: int = MAX_META) -> Frame:
    """Reads a frame's header, request id and meta; the caller reads (or drops) the payload.

    Every length is checked against its cap before anything is allocated, and the meta must be a
    JSON object: a peer cannot make us allocate, or crash a thread, with a malformed header.
    """
    kind, rid_length, meta_length, payload_length = parse_header(recv_exact(sock, HEADER.size), max_meta)
    rid = recv_exact(sock, rid_length) if rid_length else b""
    meta = recv_exact(sock, meta_length) if meta_length else b""
    return decode_frame(kind, rid, meta, payload_length)


def parse_header(raw: bytes | memoryview, max_meta: int = MAX_META) -> tuple[FrameType, int, int, int]:
    """A fixed header's (type, request-id length, meta length, payload length), every field checked."""
    magic, version, frame_type, rid_length, meta_length, payload_length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise HandshakeError("not a SmartGen peer (bad frame magic)")
    if version != PROTOCOL_VERSION:
        raise HandshakeError(f"protocol version mismatch: peer speaks {version}, we speak {PROTOCOL_VERSION}")
    if meta_length > max_meta:
        raise ConnectionError(f"frame meta of {meta_length} bytes is too large (at most {max_meta})")
    if rid_length > MAX_REQUEST_ID:
        raise ConnectionError(f"request id of {rid_length} bytes is too long (at most {MAX_REQUEST_ID})")
    try:
        kind = FrameType(frame_type)
    except ValueError:
        raise ConnectionError(f"unknown frame type {frame_type}") from None
    return kind, rid_length, meta_length, payload_length


def decode_frame(kind: FrameType, rid: bytes, meta_bytes: bytes, payload_length: int) -> Frame:
    """The frame whose request id and JSON meta are these bytes; a ConnectionError says what is unreadable."""
    try:
        request_id = rid.decode()
        meta = json.loads(meta_bytes) if meta_bytes else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConnectionError(f"{kind.name} frame: unreadable request id or meta ({exc})") from None
    if not isinstance(meta, dict):
        raise ConnectionError(f"{kind.name} frame: meta is a JSON {type(meta).__name__}, not an object")
    return Frame(kind, request_id, meta, payload_length)


def hang_up(sock: socket.socket, send_lock: threading.Lock) -> None:
    """Says BYE (if the socket still takes it) and closes it, waking a thread blocked reading it."""
    try:
        with send_lock:
            send_frame(sock, FrameType.BYE)
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
