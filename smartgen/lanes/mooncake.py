"""The Mooncake Transfer Engine as a one-sided transport (P2P handshake mode, no metadata server).

Each endpoint runs its own `mooncake.engine.TransferEngine` bound to the side channel's local
address; the peer is named by "host:rpc-port", which the engine chose (P2P handshake) and
reports, and which the endpoints swap in LANE_INFO. Writes are `batch_transfer_sync_write`
calls; the engine runs a batch's slices in parallel, so the lane fences between regions.
The protocol is Mooncake's own choice of transport: "tcp" here, "rdma" on a cluster.

Closing destroys the engine (when no call of the lane's own on it is still running; else right
after that call): its TCP server stops, joining its I/O thread, and its RPC port closes, so
nothing the peer still sends lands in our regions afterwards. Its server checks a write's
address when the write starts and then reads the body straight into the region, so
deregistering alone does not stop a write already under way.

The destructor runs with the GIL held and joins the engine's handshake listener, which sees
the stop only when its blocking accept() times out: after up to 1 s (Mooncake sets
SO_RCVTIMEO 1 s), a second in which no thread of this process runs, heartbeats included (the
lanes of a lost prefill node, closed together in the in-process failover tests, stalled the
process past the 3 s lease). So each new engine's listening socket gets a 50 ms timeout
(`_short_accept_timeout`): destroying an engine older than 1 s then takes about 50 ms.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
from collections.abc import Sequence
from typing import Any

import torch

from smartgen.lanes.extras import require
from smartgen.lanes.onesided import one_sided_factory
from smartgen.lanes.transport import Segment, Transport, TransportError

__all__ = ["MooncakeTransport", "mooncake_lane", "ACCEPT_TIMEOUT_S"]

log = logging.getLogger(__name__)
ACCEPT_TIMEOUT_S = 0.05  # the handshake listener's accept() wakes this often: the longest its engine's destructor waits


class MooncakeTransport(Transport):
    """One TransferEngine per endpoint."""

    name = "mooncake"

    @staticmethod
    def probe() -> Any:
        """The mooncake.engine module, or MissingExtra naming the extra (and the system library it needs)."""
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the engine logs every handshake at INFO
        return require("mooncake.engine", "mooncake", "needs the system library libibverbs1 too")

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        self._engine: Any = self.probe().TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransportError(
                f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed: {rc}"
            )
        port = self._engine.get_rpc_port()
        self.session = f"{host}:{port}"  # the engine's RPC server, for the peer's handshake
        if not _short_accept_timeout(port, ACCEPT_TIMEOUT_S):
            log.debug("Mooncake's handshake listener on port %d not found: destroying its engine takes up to 1 s", port)
        self._peer: str | None = None
        self._registered: set[int] = set()

    @property
    def _live(self) -> Any:
        """The engine; TransportError once closed (a lane thread may still be finishing)."""
        if self._engine is None:
            raise TransportError("Mooncake transport is closed")
        return self._engine

    def info(self) -> dict[str, Any]:
        return {"session": self.session}

    def connect(self, peer: dict[str, Any]) -> None:
        self._peer = str(peer["session"])

    def register(self, tensor: torch.Tensor) -> tuple[Any, Any]:
        addr = tensor.data_ptr()
        rc = self._live.register_memory(addr, tensor.numel() * tensor.element_size())
        if rc != 0:
            raise TransportError(f"Mooncake register_memory failed: {rc}")
        self._registered.add(addr)
        return addr, None

    def deregister(self, handle: Any) -> None:
        if handle in self._registered:
            self._registered.discard(handle)
            self._live.unregister_memory(handle)

    def write(self, segments: Sequence[Segment]) -> None:
        engine = self._live
        if self._peer is None:
            raise TransportError("Mooncake transport is not connected")
        rc = engine.batch_transfer_sync_write(
            self._peer, [s.src_addr for s in segments], [s.dst_addr for s in segments], [s.length for s in segments]
        )
        if rc != 0:
            raise TransportError(f"Mooncake batch write of {len(segments)} segments to {self._peer} failed: {rc}")

    def close(self) -> None:
        """Deregisters everything, then destroys the engine (see the module docstring); a second call does nothing."""
        if self._engine is None:
            return
        for addr in list(self._registered):
            self.deregister(addr)
        self._engine = None  # the last reference: a call still running holds its own, and the engine goes after it


def _short_accept_timeout(port: int, seconds: float) -> bool:
    """Sets SO_RCVTIMEO of the engine's handshake listener (the listening socket on `port`); False when there is
    none. The accept() already waiting keeps its 1 s."""
    sock = _listener_of(port)
    if sock is None:
        return False
    with sock:  # a duplicate: closing it leaves the engine's socket open, with the option set
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, round(seconds * 1e6)))
    return True


def _listener_of(port: int) -> socket.socket | None:
    """A duplicate of this process's listening TCP socket on `port` (the caller closes it), or None."""
    names = os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []
    for name in names:
        try:  # any descriptor may be closed, or its number reused, by another thread meanwhile
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            duplicate = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            sock = socket.socket(fileno=duplicate)
        except OSError:
            os.close(duplicate)
            continue
        try:
            if (
                sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                and sock.getsockname()[1] == port
            ):
                return sock
        except OSError:
            pass
        sock.close()
    return None


# a lane factory for TcpListener/tcp_connect: Mooncake for the writes, the authenticated socket as the side channel
mooncake_lane = one_sided_factory(lambda sock, timeouts: MooncakeTransport(host=sock.getsockname()[0]))
