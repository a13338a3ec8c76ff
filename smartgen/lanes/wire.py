"""The TCP wire format: fixed-header frames, and the authenticated handshake that opens a connection.

Every frame is an 18-byte little-endian header, then the request id, a JSON meta block and
a raw payload:

    magic "SG" | version u8 | type u8 | request-id length u16 | meta length u32 | payload length u64

See docs/protocol.md for the frame types and the handshake.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
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
    "send_frame",
    "recv_header",
    "server_handshake",
    "client_handshake",
    "hang_up",
]

PROTOCOL_VERSION = 1
MAGIC = b"SG"
HEADER = struct.Struct("<2sBBHIQ")
MAX_META = 16 * 2**20  # a frame's JSON meta above this is a protocol error, not an allocation


class FrameType(IntEnum):
    CHALLENGE = 1  # server -> client: nonce, server's version
    HELLO = 2  # client -> server: version, HMAC of the nonce, model fingerprint, layout, channel
    WELCOME = 3  # server -> client: accepted
    REJECT = 4  # server -> client: refused, with the reason
    WRITE = 5  # one-sided writes: meta {"seq", "ops": [[dst, offset, length], ...]}, payload = their bytes
    ACK = 6  # receiver -> sender: every WRITE up to meta["seq"] has been applied (or dropped)
    MESSAGE = 7  # a two-sided message: meta {"kind", "meta", "payload": [[name, dtype, shape], ...]}, payload
    FLUSH = 8  # sender -> receiver: answer with ACK once everything before this is applied
    BYE = 9  # orderly close
    # one-sided lanes (Mooncake, NIXL, RDMA): the bytes move through the transport, this socket is the side channel
    LANE_INFO = 10  # both ways, once: how to reach this endpoint's transport (session, agent metadata, QP)
    REGION = 11  # owner -> writer: a registered region, meta {"name", "addr", "length", "key"}
    ACCEPT = 12  # owner -> writer: meta {"token"}; the writer may now write for this request
    REVOKE = 13  # owner -> writer: meta {"token"}; the writer stops writing for this request
    CONFIRM = 14  # writer -> owner: meta {"token"}; the ACCEPT/REVOKE is in force (nothing in flight for a REVOKE)


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
    rid = request_id.encode()
    meta_bytes = json.dumps(meta or {}, separators=(",", ":")).encode()
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(frame_type), len(rid), len(meta_bytes), payload_length)
    sock.sendall(header + rid + meta_bytes)


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


def recv_header(sock: socket.socket) -> Frame:
    """Reads a frame's header, request id and meta; the caller reads (or drops) the payload."""
    magic, version, frame_type, rid_length, meta_length, payload_length = HEADER.unpack(recv_exact(sock, HEADER.size))
    if magic != MAGIC:
        raise HandshakeError("not a SmartGen peer (bad frame magic)")
    if version != PROTOCOL_VERSION:
        raise HandshakeError(f"protocol version mismatch: peer speaks {version}, we speak {PROTOCOL_VERSION}")
    if meta_length > MAX_META:
        raise ConnectionError(f"frame meta of {meta_length} bytes is too large")
    request_id = recv_exact(sock, rid_length).decode() if rid_length else ""
    meta = json.loads(recv_exact(sock, meta_length)) if meta_length else {}
    return Frame(FrameType(frame_type), request_id, meta, payload_length)


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


def _mac(secret: str, nonce: str) -> str:
    return hmac.new(secret.encode(), bytes.fromhex(nonce), hashlib.sha256).hexdigest()


def server_handshake(sock: socket.socket, secret: str, identity: dict[str, Any]) -> dict[str, Any]:
    """Prefill side: challenge, check the HELLO (version, secret, model), welcome or reject.

    `identity` holds this node's model fingerprint and KV layout; returns the client's HELLO meta.
    """
    nonce = os.urandom(16).hex()
    send_frame(sock, FrameType.CHALLENGE, meta={"nonce": nonce, "version": PROTOCOL_VERSION})
    try:
        frame = recv_header(sock)
    except HandshakeError as exc:
        # a peer speaking another version: tell it why before hanging up
        _reject(sock, str(exc))
        raise
    if frame.type != FrameType.HELLO:
        raise HandshakeError(f"expected HELLO, got {frame.type.name}")
    hello = frame.meta
    reason = None
    if not hmac.compare_digest(str(hello.get("mac", "")), _mac(secret, nonce)):
        reason = "authentication failed: wrong shared secret"
    elif hello.get("fingerprint") != identity.get("fingerprint"):
        reason = (
            f"model mismatch: prefill node serves {identity.get('model')} ({identity.get('fingerprint')}), "
            f"decode node has {hello.get('model')} ({hello.get('fingerprint')})"
        )
    elif hello.get("layout") != identity.get("layout"):
        reason = f"KV layout mismatch: prefill {identity.get('layout')}, decode {hello.get('layout')}"
    elif hello.get("lane", "tcp") != identity.get("lane", "tcp"):
        reason = (
            f"lane mismatch: prefill node runs --lane {identity.get('lane', 'tcp')}, decode {hello.get('lane', 'tcp')}"
        )
    if reason:
        _reject(sock, reason)
        raise HandshakeError(reason)
    send_frame(sock, FrameType.WELCOME, meta={"version": PROTOCOL_VERSION})
    return hello


def _reject(sock: socket.socket, reason: str) -> None:
    try:
        send_frame(sock, FrameType.REJECT, meta={"reason": reason})
    except OSError:
        pass


def client_handshake(sock: socket.socket, secret: str, hello: dict[str, Any], version: int = PROTOCOL_VERSION) -> None:
    """Decode side: answer the challenge with our HELLO; raise HandshakeError with the server's reason on refusal."""
    frame = recv_header(sock)
    if frame.type != FrameType.CHALLENGE:
        raise HandshakeError(f"expected CHALLENGE, got {frame.type.name}")
    meta = {**hello, "mac": _mac(secret, frame.meta["nonce"])}
    rid = b""
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    # the version byte is ours to set (tests speak an old version on purpose)
    sock.sendall(HEADER.pack(MAGIC, version, int(FrameType.HELLO), len(rid), len(meta_bytes), 0) + meta_bytes)
    reply = recv_header(sock)
    if reply.type == FrameType.REJECT:
        raise HandshakeError(f"prefill node refused the connection: {reply.meta.get('reason')}")
    if reply.type != FrameType.WELCOME:
        raise HandshakeError(f"expected WELCOME, got {reply.type.name}")
