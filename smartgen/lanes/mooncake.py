"""The Mooncake Transfer Engine as a one-sided transport (P2P handshake mode, no metadata server).

Each endpoint runs its own `mooncake.engine.TransferEngine` bound to the side channel's local
address; the peer is named by "host:rpc-port", which the engine chose (P2P handshake) and
reports, and which the endpoints swap in LANE_INFO. Writes are `batch_transfer_sync_write`
calls; the engine runs a batch's slices in parallel, so the lane fences between regions.
The protocol is Mooncake's own choice of transport: "tcp" here, "rdma" on a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from smartgen.lanes.extras import require
from smartgen.lanes.onesided import one_sided_factory
from smartgen.lanes.transport import Segment, Transport, TransportError

__all__ = ["MooncakeTransport", "mooncake_lane"]


class MooncakeTransport(Transport):
    """One TransferEngine per endpoint."""

    name = "mooncake"

    @staticmethod
    def probe() -> Any:
        """The mooncake.engine module, or MissingExtra naming the extra (and the system library it needs)."""
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the engine logs every handshake at INFO
        return require("mooncake.engine", "mooncake", "needs the system library libibverbs1 too")

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        self._engine = self.probe().TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransportError(
                f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed: {rc}"
            )
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._peer: str | None = None
        self._registered: set[int] = set()

    def info(self) -> dict[str, Any]:
        return {"session": self.session}

    def connect(self, peer: dict[str, Any]) -> None:
        self._peer = str(peer["session"])

    def register(self, tensor: torch.Tensor) -> tuple[Any, Any]:
        addr = tensor.data_ptr()
        rc = self._engine.register_memory(addr, tensor.numel() * tensor.element_size())
        if rc != 0:
            raise TransportError(f"Mooncake register_memory failed: {rc}")
        self._registered.add(addr)
        return addr, None

    def deregister(self, handle: Any) -> None:
        if handle in self._registered:
            self._registered.discard(handle)
            self._engine.unregister_memory(handle)

    def write(self, segments: Sequence[Segment]) -> None:
        if self._peer is None:
            raise TransportError("Mooncake transport is not connected")
        rc = self._engine.batch_transfer_sync_write(
            self._peer, [s.src_addr for s in segments], [s.dst_addr for s in segments], [s.length for s in segments]
        )
        if rc != 0:
            raise TransportError(f"Mooncake batch write of {len(segments)} segments to {self._peer} failed: {rc}")

    def close(self) -> None:
        for addr in list(self._registered):
            self.deregister(addr)


# a lane factory for TcpListener/tcp_connect: Mooncake for the writes, the authenticated socket as the side channel
mooncake_lane = one_sided_factory(lambda sock, timeouts: MooncakeTransport(host=sock.getsockname()[0]))
