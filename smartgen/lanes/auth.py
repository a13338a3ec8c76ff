"""The authenticated handshake that opens a TCP connection: both ends prove the shared secret.

1. prefill -> decode  CHALLENGE {nonce_s, version}
2. decode -> prefill  HELLO {identity..., nonce_c, mac_c}
       mac_c = HMAC(secret, "client" | nonce_s | nonce_c | SHA-256(HELLO meta without mac_c))
3. prefill -> decode  WELCOME {mac_s}   (or REJECT {reason})
       mac_s = HMAC(secret, "server" | nonce_s | nonce_c | mac_c)

Both proofs cover both fresh nonces, so neither can be replayed on another connection or
reflected back at its sender, and the decode node sends nothing (no prompt ids, no pool
regions) until the prefill node has proved it holds the secret. The secret never crosses the
wire. Before authentication every frame's meta is capped at MAX_HANDSHAKE_META.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
from typing import Any

from smartgen.lanes.wire import (
    HEADER,
    MAGIC,
    MAX_HANDSHAKE_META,
    PROTOCOL_VERSION,
    FrameType,
    HandshakeError,
    recv_header,
    send_frame,
)

__all__ = ["server_handshake", "client_handshake", "client_mac", "server_mac"]


def _digest(meta: dict[str, Any]) -> bytes:
    """A canonical hash of a HELLO's meta (its mac left out): the transcript the client signs."""
    body = {k: v for k, v in meta.items() if k != "mac"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).digest()


def _hmac(secret: str, label: bytes, *parts: bytes) -> str:
    return hmac.new(secret.encode(), label + b"\0" + b"\0".join(parts), hashlib.sha256).hexdigest()


def _nonce_bytes(nonce: Any) -> bytes:
    if not isinstance(nonce, str) or len(nonce) != 32:
        raise HandshakeError("malformed handshake: bad nonce")
    try:
        return bytes.fromhex(nonce)
    except ValueError:
        raise HandshakeError("malformed handshake: bad nonce") from None


def _same(claimed: Any, expected: str) -> bool:
    """Constant-time comparison of a peer's MAC (any JSON value, any characters) with ours."""
    return hmac.compare_digest(str(claimed).encode("utf-8", "replace"), expected.encode())


def client_mac(secret: str, nonce_s: Any, hello: dict[str, Any]) -> str:
    """The decode node's proof, over both nonces and the rest of its HELLO."""
    return _hmac(secret, b"client", _nonce_bytes(nonce_s), _nonce_bytes(hello.get("nonce")), _digest(hello))


def server_mac(secret: str, nonce_s: Any, nonce_c: Any, mac_c: str) -> str:
    """The prefill node's proof, over both nonces and the client's proof."""
    return _hmac(secret, b"server", _nonce_bytes(nonce_s), _nonce_bytes(nonce_c), mac_c.encode())


def server_handshake(sock: socket.socket, secret: str, identity: dict[str, Any]) -> dict[str, Any]:
    """Prefill side: challenge, check the HELLO (version, secret, model), prove our secret or reject.

    `identity` holds this node's model fingerprint and KV layout; returns the client's HELLO meta.
    """
    nonce = os.urandom(16).hex()
    send_frame(sock, FrameType.CHALLENGE, meta={"nonce": nonce, "version": PROTOCOL_VERSION})
    try:
        frame = recv_header(sock, MAX_HANDSHAKE_META)
    except HandshakeError as exc:
        _reject(sock, str(exc))  # a peer speaking another version: tell it why before hanging up
        raise
    if frame.type != FrameType.HELLO or frame.payload_length:
        raise HandshakeError(f"expected HELLO, got {frame.type.name}")
    hello = frame.meta
    reason = _check_hello(secret, nonce, hello, identity)
    if reason:
        _reject(sock, reason)
        raise HandshakeError(reason)
    proof = server_mac(secret, nonce, hello["nonce"], hello["mac"])
    send_frame(sock, FrameType.WELCOME, meta={"version": PROTOCOL_VERSION, "mac": proof})
    return hello


def _check_hello(secret: str, nonce: str, hello: dict[str, Any], identity: dict[str, Any]) -> str | None:
    """Why this HELLO is refused (secret first: an unauthenticated peer learns nothing else), or None."""
    try:
        expected = client_mac(secret, nonce, hello)
    except HandshakeError as exc:
        return str(exc)
    if not _same(hello.get("mac"), expected):
        return "authentication failed: wrong shared secret"
    if hello.get("fingerprint") != identity.get("fingerprint"):
        return (
            f"model mismatch: prefill node serves {identity.get('model')} ({identity.get('fingerprint')}), "
            f"decode node has {hello.get('model')} ({hello.get('fingerprint')})"
        )
    if hello.get("layout") != identity.get("layout"):
        return f"KV layout mismatch: prefill {identity.get('layout')}, decode {hello.get('layout')}"
    if hello.get("lane", "tcp") != identity.get("lane", "tcp"):
        return (
            f"lane mismatch: prefill node runs --lane {identity.get('lane', 'tcp')}, decode {hello.get('lane', 'tcp')}"
        )
    return None


def _reject(sock: socket.socket, reason: str) -> None:
    try:
        send_frame(sock, FrameType.REJECT, meta={"reason": reason})
    except OSError:
        pass


def client_handshake(sock: socket.socket, secret: str, hello: dict[str, Any], version: int = PROTOCOL_VERSION) -> None:
    """Decode side: answer the challenge, then check the prefill node's proof; HandshakeError on any refusal."""
    frame = recv_header(sock, MAX_HANDSHAKE_META)
    if frame.type != FrameType.CHALLENGE:
        raise HandshakeError(f"expected CHALLENGE, got {frame.type.name}")
    nonce_s = frame.meta.get("nonce")
    meta = {**hello, "nonce": os.urandom(16).hex()}
    meta["mac"] = client_mac(secret, nonce_s, meta)
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    # the version byte is ours to set (tests speak an old version on purpose)
    sock.sendall(HEADER.pack(MAGIC, version, int(FrameType.HELLO), 0, len(meta_bytes), 0) + meta_bytes)
    reply = recv_header(sock, MAX_HANDSHAKE_META)
    if reply.type == FrameType.REJECT:
        raise HandshakeError(f"prefill node refused the connection: {reply.meta.get('reason')}")
    if reply.type != FrameType.WELCOME:
        raise HandshakeError(f"expected WELCOME, got {reply.type.name}")
    expected = server_mac(secret, nonce_s, meta["nonce"], meta["mac"])
    if not _same(reply.meta.get("mac"), expected):
        raise HandshakeError(
            "the prefill node did not prove the shared secret (wrong secret, or not a SmartGen prefill node)"
        )
