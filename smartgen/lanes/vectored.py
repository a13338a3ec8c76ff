"""Scatter-gather socket I/O: many buffers per system call (sendmsg, recvmsg_into); one at a time on TLS sockets.

A WRITE frame of scattered blocks is a list of small buffers on both ends (the source rows, the
destination rows in the pool). Sent or received one call per buffer, a 4 KiB block costs a system
call on each side; here up to `MAX_BUFFERS` go in one call, the socket's own SGE list. Python's
SSLSocket has neither call, so TLS keeps the per-buffer loop.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Sequence

from smartgen.lanes.wire import ConnectionClosed, recv_into_exact

__all__ = ["MAX_BUFFERS", "send_views", "recv_into_views"]

try:
    MAX_BUFFERS = min(int(os.sysconf("SC_IOV_MAX")), 512)  # Linux: 1024; more per call gains nothing measurable
except (AttributeError, ValueError, OSError):
    MAX_BUFFERS = 16


def _vectored(sock: socket.socket, call: str) -> bool:
    return not isinstance(sock, ssl.SSLSocket) and hasattr(sock, call)


def send_views(sock: socket.socket, views: Sequence[memoryview | bytes]) -> None:
    """Sends every buffer, in order, whole; as few system calls as the kernel allows."""
    if not _vectored(sock, "sendmsg"):
        for view in views:
            sock.sendall(view)
        return
    pending = [v if isinstance(v, memoryview) else memoryview(v) for v in views if len(v)]
    first = 0
    while first < len(pending):
        sent = sock.sendmsg(pending[first : first + MAX_BUFFERS])
        while first < len(pending) and sent >= pending[first].nbytes:  # drop what went whole
            sent -= pending[first].nbytes
            first += 1
        if sent:  # a partial buffer: its rest goes first next time
            pending[first] = pending[first][sent:]


def recv_into_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fills every buffer, in order, from the stream; bytes land straight in the caller's memory."""
    if not _vectored(sock, "recvmsg_into"):
        for view in views:
            recv_into_exact(sock, view)
        return
    pending = [v for v in views if v.nbytes]
    first = 0
    while first < len(pending):
        received = sock.recvmsg_into(pending[first : first + MAX_BUFFERS])[0]
        if received == 0:
            raise ConnectionClosed("peer closed the connection")
        while first < len(pending) and received >= pending[first].nbytes:
            received -= pending[first].nbytes
            first += 1
        if received:
            pending[first] = pending[first][received:]
