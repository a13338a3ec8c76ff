"""The RDMA lane: one RC queue pair per endpoint, set up over the authenticated TCP side channel.

The side channel (the TCP lane's handshake: shared secret, model, layout) carries LANE_INFO
with each end's QPN, PSN, LID, GID and MTU, then REGION frames with each region's address and
rkey. A push is one ordered WRITE list, posted in doorbell batches with selective signalling;
RC delivers it in order, so no fence is needed between data and mask (`ordered = True`).
Two-sided messages (the fetch RPC included) ride the side channel for now; verbs.py has the
SEND/RECV with per-row scatter lists that a verbs-native fetch path will use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from smartgen.lanes.onesided import OneSidedLane, one_sided_factory
from smartgen.lanes.rdma.gpu_memory import DeviceMR, gpudirect_status, register_device_memory
from smartgen.lanes.rdma.handshake import QpInfo
from smartgen.lanes.rdma.plan import SendQueue, plan_writes
from smartgen.lanes.rdma.select import RdmaOptions
from smartgen.lanes.rdma.verbs import VerbsEndpoint
from smartgen.lanes.transport import Segment, Transport, TransportError

__all__ = ["RdmaTransport", "rdma_lane", "rdma_lane_for"]


class RdmaTransport(Transport):
    """Verbs WRITEs on one RC queue pair."""

    name = "rdma"
    ordered = True

    def __init__(
        self,
        device: str | None = None,
        port: int | None = None,
        gid_index: int | None = None,
        write_timeout_s: float = 30.0,
    ) -> None:
        self.write_timeout_s = write_timeout_s  # WRITEs not completed by then break the lane
        self.endpoint = VerbsEndpoint(device, port, gid_index)
        self._queue = SendQueue(self.endpoint.limits.max_send_wr)
        self._next_wr_id = 1

    def info(self) -> dict[str, Any]:
        return self.endpoint.info.to_meta()

    def connect(self, peer: dict[str, Any]) -> None:
        self.endpoint.connect(QpInfo.from_meta(peer))

    @classmethod
    def registers_device_memory(cls, device: torch.device) -> bool:
        return device.type == "cuda" and bool(gpudirect_status(device.index or 0).routes)

    def register(self, tensor: torch.Tensor) -> tuple[Any, Any]:
        addr, length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if tensor.device.type == "cuda":  # GPUDirect RDMA: the NIC reaches GPU memory itself (gpu_memory.py)
            e = self.endpoint
            mr = register_device_memory(e.pd, e.v["mr"], addr, length, e.access, tensor.device.index or 0)
        else:
            mr = self.endpoint.register(addr, length)
        return mr, mr.rkey

    def region_address(self, handle: Any, tensor: torch.Tensor) -> int:
        return handle.address(tensor.data_ptr()) if isinstance(handle, DeviceMR) else tensor.data_ptr()

    def deregister(self, handle: Any) -> None:
        handle.close()

    def write(self, segments: Sequence[Segment]) -> None:
        keyed = [s._replace(src_key=s.src_key.lkey) for s in segments]
        batches = plan_writes(keyed, self.endpoint.limits, self._next_wr_id)
        self._next_wr_id += sum(len(b) for b in batches)
        deadline = time.monotonic() + self.write_timeout_s
        for batch in batches:
            while not self._queue.fits(batch):
                self._retire(deadline)
            self.endpoint.post_writes(batch)
            self._queue.posted(batch)
        while self._queue.in_use:  # the list's last WRITE is signalled: this returns once all have landed
            self._retire(deadline)

    def _retire(self, deadline: float) -> None:
        for wr_id in self.endpoint.poll():
            self._queue.completed(wr_id)
        if time.monotonic() > deadline:
            raise TransportError(f"RDMA WRITEs not completed after {self.write_timeout_s:g} s")

    def close(self) -> None:
        self.endpoint.close()


def rdma_lane_for(options: RdmaOptions) -> Callable[..., OneSidedLane]:
    """A lane factory for TcpListener/tcp_connect on the asked device, port and GID index: verbs WRITEs, the
    authenticated socket as the side channel."""
    return one_sided_factory(
        lambda sock, timeouts: RdmaTransport(
            options.device, options.port, options.gid_index, write_timeout_s=timeouts.write_s
        )
    )


rdma_lane = rdma_lane_for(RdmaOptions())  # everything chosen automatically
