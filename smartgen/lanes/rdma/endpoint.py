"""What the RDMA lane asks of a verbs endpoint: two RC queue pairs in one protection domain, posting and polling.

`verbs.VerbsEndpoint` implements it with pyverbs on a device. Everything the lane decides (work
requests, scatter lists, message fragments, which reply lands where) is planned above this line,
so it runs the same over any implementation of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from smartgen.lanes.rdma.handshake import QpInfo, QpRole
from smartgen.lanes.rdma.plan import QueueLimits, Sge, WriteWR

__all__ = ["Endpoint", "MemoryHandle"]


class MemoryHandle(Protocol):
    """A registered memory region."""

    lkey: int
    rkey: int

    def close(self) -> None: ...


class Endpoint(Protocol):
    """A protection domain with a MAIN and a REPLY queue pair, a send CQ and a receive CQ.

    Work-request ids are the caller's: sends of both queue pairs complete on the send CQ, receives
    of both on the receive CQ; the caller tells them apart by the ids it chose. The send CQ is
    polled by one thread and the receive CQ by another.
    """

    limits: QueueLimits

    def qp_infos(self) -> dict[QpRole, QpInfo]:
        """What the peer needs to connect to each queue pair."""
        ...

    def connect(self, remote: dict[QpRole, QpInfo]) -> None:
        """Takes each queue pair to RTS against the peer's queue pair of the same role."""
        ...

    def register(self, addr: int, length: int, device_index: int | None = None) -> MemoryHandle:
        """Registers memory for local access, remote WRITEs and RECV scatter: host memory, or with `device_index`
        that CUDA device's memory (GPUDirect RDMA)."""
        ...

    def post_writes(self, batch: Sequence[WriteWR]) -> None:
        """One doorbell of WRITEs on MAIN."""
        ...

    def post_send(self, role: QpRole, sges: Sequence[Sge], wr_id: int) -> None:
        """One signalled SEND gathering `sges` on the queue pair `role`."""
        ...

    def post_recvs(self, role: QpRole, recvs: Sequence[tuple[int, Sequence[Sge]]]) -> None:
        """RECVs on `role`'s receive queue, in order: (wr_id, scatter list) each."""
        ...

    def poll_send(self, max_entries: int = 16) -> list[int]:
        """wr_ids of the send completions ready now; TransportError on a failed one."""
        ...

    def poll_recv(self, max_entries: int = 16) -> list[tuple[int, int]]:
        """(wr_id, bytes received) of the receive completions ready now; TransportError on a failed one."""
        ...

    def close(self) -> None:
        """Destroys the queue pairs (posted work is flushed) and releases the device."""
        ...
