"""Heartbeats and leases on a socket: a peer that dies or goes silent is noticed within one lease.

Each authenticated socket gets a receive timeout of one lease (`arm`): a recv that waits
longer than that, in a frame header or in the middle of a payload, means the peer is dead,
frozen or cut off, and the lane closes with that reason. So that an idle but healthy peer is
never mistaken for a dead one, each endpoint sends a HEARTBEAT frame every `lease / 4`
seconds (`heartbeat_loop`). A payload in flight needs no heartbeats: its bytes keep arriving
(pacing sends ~2 ms chunks), and a send that the peer does not drain within a lease fails too.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from smartgen.lanes.wire import FrameType, send_frame

__all__ = ["Lease", "DEFAULT_LEASE_S", "arm", "arm_in_kernel", "heartbeat_loop", "lease_of"]

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 3.0


@dataclass(frozen=True, slots=True)
class Lease:
    """How long a peer may stay silent before it is declared dead."""

    seconds: float = DEFAULT_LEASE_S

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"a lease must be positive, got {self.seconds}")

    @property
    def heartbeat_s(self) -> float:
        # four beats per lease: a lost or late beat or two never expires a live peer's lease
        return self.seconds / 4


def arm(sock: socket.socket, lease: Lease | None) -> None:
    """Sets the socket's timeout to the lease (None: no lease, block forever, as before heartbeats)."""
    sock.settimeout(None if lease is None else lease.seconds)


def lease_of(sock: socket.socket) -> Lease | None:
    """The lease an armed socket carries (lanes read it here, so every lane factory keeps its signature)."""
    timeout = sock.gettimeout()
    return Lease(timeout) if timeout else None


def arm_in_kernel(sock: socket.socket, lease: Lease) -> bool:
    """Moves the lease from Python's socket timeout to the kernel's (SO_RCVTIMEO, SO_SNDTIMEO); False where it cannot.

    With a Python timeout every recv and send is preceded by a poll() system call (and a GIL hand-off); a
    blocking socket with kernel timeouts makes one call, and a call that waits longer than the lease fails
    with EAGAIN (BlockingIOError) instead of TimeoutError. TLS sockets keep Python's timeout: their reads
    need it to tell a silent peer from an incomplete record.
    """
    if isinstance(sock, ssl.SSLSocket) or not hasattr(socket, "SO_RCVTIMEO"):
        return False
    seconds = int(lease.seconds)
    timeval = struct.pack("ll", seconds, int((lease.seconds - seconds) * 1e6))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    except OSError:
        return False
    sock.settimeout(None)
    return True


def heartbeat_loop(
    sock: socket.socket,
    send_lock: threading.Lock,
    closed: threading.Event,
    on_broken: Callable[[str], None],
    lease: Lease,
) -> None:
    """Sends HEARTBEAT every `lease.heartbeat_s` until `closed`; a failed send breaks the lane."""
    while not closed.wait(lease.heartbeat_s):
        try:
            with send_lock:  # whole frames only: a payload being sent finishes first (its bytes count as life)
                send_frame(sock, FrameType.HEARTBEAT)
        except OSError as exc:
            on_broken(f"heartbeat not sent: {exc}")
            return
