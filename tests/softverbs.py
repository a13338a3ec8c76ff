"""A software RDMA endpoint for tests: two RC queue pairs per endpoint, joined inside one process.

It keeps the semantics the RDMA lane relies on, the ones a NIC gives: each queue pair executes its
send queue in posting order (a WRITE's bytes are in the peer's memory before anything posted after
it completes there); a SEND consumes the peer's oldest posted RECV of that queue pair and scatters
into its list, or waits while none is posted (RNR retry without end, as the lane sets it); a SEND
longer than the RECV's list fails both ends; a WRITE or RECV outside a registered region, or with a
wrong key, fails; an unsignalled WRITE completes silently; a queue pair in error flushes what is
posted on it with failed completions, and a peer's SEND to it fails. The "DMA" is `ctypes.memmove`
between addresses of this process, so both endpoints must live in one process (the lane contract
tests' loopback links). Not a model of timing: the lane's pacer is what paces.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from smartgen.lanes.rdma.handshake import QpInfo, QpRole
from smartgen.lanes.rdma.plan import QueueLimits, Sge, WriteWR
from smartgen.lanes.transport import TransportError

__all__ = ["SoftEndpoint"]

OK, FAILED, FLUSHED = 0, 1, 5  # IBV_WC_SUCCESS, a generic error, IBV_WC_WR_FLUSH_ERR
_qps: dict[int, SoftQp] = {}
_registry_lock = threading.Lock()
_qpns = itertools.count(0x100)
_keys = itertools.count(0x1000)


class _WcError(Exception):
    pass


@dataclass(slots=True)
class SoftMr:
    addr: int
    length: int
    lkey: int
    rkey: int
    endpoint: SoftEndpoint

    def close(self) -> None:
        with self.endpoint.lock:
            self.endpoint.mrs.pop(self.lkey, None)


class _Cq:
    def __init__(self) -> None:
        self.entries: deque[tuple[int, int, int]] = deque()  # (wr_id, status, byte_len)
        self.lock = threading.Lock()

    def push(self, wr_id: int, status: int, byte_len: int = 0) -> None:
        with self.lock:
            self.entries.append((wr_id, status, byte_len))

    def poll(self, max_entries: int) -> list[tuple[int, int, int]]:
        with self.lock:
            return [self.entries.popleft() for _ in range(min(max_entries, len(self.entries)))]


class SoftQp:
    def __init__(self, endpoint: SoftEndpoint, role: QpRole) -> None:
        self.endpoint, self.role = endpoint, role
        self.qpn = next(_qpns)
        self.remote: SoftQp | None = None
        self.cond = threading.Condition()
        self.sq: deque[tuple[str, object]] = deque()
        self.rq: deque[tuple[int, list[Sge]]] = deque()
        self.error = False
        self.thread = threading.Thread(target=self._run, name=f"softnic-{self.qpn}", daemon=True)
        with _registry_lock:
            _qps[self.qpn] = self

    def post(self, kind: str, work: object) -> None:
        with self.cond:
            if self.error:  # posted to a queue pair in error: flushed at once
                self._flush_one(kind, work)
                return
            self.sq.append((kind, work))
            self.cond.notify_all()

    def post_recv(self, wr_id: int, sges: list[Sge]) -> None:
        with self.cond:
            if self.error:
                self.endpoint.recv_cq.push(wr_id, FLUSHED)
                return
            if len(self.rq) >= self.endpoint.limits.max_send_wr:  # ibv_post_recv fails with ENOMEM
                raise TransportError(f"receive queue full ({len(self.rq)} RECVs posted)")
            self.rq.append((wr_id, sges))
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.sq and not self.error:
                    self.cond.wait()
                if self.error:
                    return
                kind, work = self.sq.popleft()
            try:
                if kind == "write":
                    self._write(work)  # type: ignore[arg-type]
                else:
                    self._send(*work)  # type: ignore[misc]
            except _WcError:
                self.endpoint.send_cq.push(self._wr_id(kind, work), FAILED)
                self.to_error()
                if self.remote is not None:
                    self.remote.to_error()
                return

    @staticmethod
    def _wr_id(kind: str, work: object) -> int:
        return work.wr_id if kind == "write" else work[0]  # type: ignore[attr-defined,index]

    def _write(self, wr: WriteWR) -> None:
        data = self.endpoint.gather([wr.sge])
        remote = self._peer()
        remote.endpoint.check_remote(wr.rkey, wr.remote_addr, len(data))
        ctypes.memmove(wr.remote_addr, data, len(data))
        if wr.signaled:
            self.endpoint.send_cq.push(wr.wr_id, OK)

    def _send(self, wr_id: int, sges: list[Sge]) -> None:
        data = self.endpoint.gather(sges)
        remote = self._peer()
        with remote.cond:
            while not remote.rq and not remote.error:  # receiver not ready: retry until it posts a RECV
                remote.cond.wait(0.05)
            if remote.error:
                raise _WcError("peer queue pair in error")
            recv_id, scatter = remote.rq.popleft()
        if len(data) > sum(s.length for s in scatter):
            remote.endpoint.recv_cq.push(recv_id, FAILED)
            remote.to_error()
            raise _WcError("SEND longer than the RECV's scatter list")
        try:
            remote.endpoint.scatter(scatter, data)
        except _WcError:
            remote.endpoint.recv_cq.push(recv_id, FAILED)
            remote.to_error()
            raise
        remote.endpoint.recv_cq.push(recv_id, OK, len(data))
        self.endpoint.send_cq.push(wr_id, OK)

    def _peer(self) -> SoftQp:
        if self.remote is None or self.remote.error:
            raise _WcError("peer gone")
        return self.remote

    def to_error(self) -> None:
        with self.cond:
            if self.error:
                return
            self.error = True
            while self.sq:
                self._flush_one(*self.sq.popleft())
            while self.rq:
                self.endpoint.recv_cq.push(self.rq.popleft()[0], FLUSHED)
            self.cond.notify_all()

    def _flush_one(self, kind: str, work: object) -> None:
        self.endpoint.send_cq.push(self._wr_id(kind, work), FLUSHED)


class SoftEndpoint:
    """The `Endpoint` protocol (smartgen/lanes/rdma/endpoint.py) without a device."""

    def __init__(self, queue_depth: int = 64, max_sge: int = 4, max_msg_bytes: int = 2**31, signal_every: int = 8):
        # small limits on purpose: the lane's batching, chunking and queue accounting get exercised
        self.limits = QueueLimits(queue_depth, max_sge, max_msg_bytes, signal_every)
        self.lock = threading.Lock()
        self.mrs: dict[int, SoftMr] = {}
        self.send_cq, self.recv_cq = _Cq(), _Cq()
        self.qps = {role: SoftQp(self, role) for role in QpRole}
        self.posted_sends = 0
        self.max_recv_sges = 0  # the longest scatter list posted, for tests

    def qp_infos(self) -> dict[QpRole, QpInfo]:
        return {role: QpInfo(qp.qpn, 0, 1, "fe80::1", 0, 5, 1) for role, qp in self.qps.items()}

    def connect(self, remote: dict[QpRole, QpInfo]) -> None:
        for role, qp in self.qps.items():
            with _registry_lock:
                peer = _qps.get(remote[role].qpn)
            if peer is None:
                raise TransportError(f"no soft queue pair {remote[role].qpn}")
            qp.remote = peer
            qp.thread.start()

    def register(self, addr: int, length: int, device_index: int | None = None) -> SoftMr:
        if device_index is not None:
            raise TransportError("the software endpoint reaches host memory only")
        key = next(_keys)
        mr = SoftMr(addr, length, key, key, self)
        with self.lock:
            self.mrs[key] = mr
        return mr

    def _region(self, key: int, addr: int, length: int) -> None:
        with self.lock:
            mr = self.mrs.get(key)
        if mr is None or not (mr.addr <= addr and addr + length <= mr.addr + mr.length):
            raise _WcError(f"{length} bytes at {addr:#x} are outside memory region {key}")

    def check_remote(self, rkey: int, addr: int, length: int) -> None:
        self._region(rkey, addr, length)

    def gather(self, sges: Sequence[Sge]) -> bytes:
        parts = []
        for s in sges:
            self._region(s.lkey, s.addr, s.length)
            parts.append(ctypes.string_at(s.addr, s.length))
        return b"".join(parts)

    def scatter(self, sges: Sequence[Sge], data: bytes) -> None:
        done = 0
        for s in sges:
            if done >= len(data):
                break
            self._region(s.lkey, s.addr, s.length)
            piece = data[done : done + s.length]
            ctypes.memmove(s.addr, piece, len(piece))
            done += len(piece)

    def post_writes(self, batch: Sequence[WriteWR]) -> None:
        for wr in batch:
            self.qps[QpRole.MAIN].post("write", wr)
        self.posted_sends += len(batch)

    def post_send(self, role: QpRole, sges: Sequence[Sge], wr_id: int) -> None:
        if len(sges) > self.limits.max_sge:
            raise TransportError(f"{len(sges)} SGEs in one SEND; the device takes {self.limits.max_sge}")
        self.qps[role].post("send", (wr_id, list(sges)))
        self.posted_sends += 1

    def post_recvs(self, role: QpRole, recvs: Sequence[tuple[int, Sequence[Sge]]]) -> None:
        for wr_id, sges in recvs:
            if len(sges) > self.limits.max_sge:
                raise TransportError(f"{len(sges)} SGEs in one RECV; the device takes {self.limits.max_sge}")
            self.max_recv_sges = max(self.max_recv_sges, len(sges))
            self.qps[role].post_recv(wr_id, list(sges))

    def _poll(self, cq: _Cq, max_entries: int) -> list[tuple[int, int, int]]:
        done = cq.poll(max_entries)
        for wr_id, status, _ in done:
            if status != OK:
                raise TransportError(f"RDMA work request {wr_id} failed: status {status}")
        return done

    def poll_send(self, max_entries: int = 16) -> list[int]:
        return [wr_id for wr_id, _, _ in self._poll(self.send_cq, max_entries)]

    def poll_recv(self, max_entries: int = 16) -> list[tuple[int, int]]:
        return [(wr_id, length) for wr_id, _, length in self._poll(self.recv_cq, max_entries)]

    def close(self) -> None:
        for qp in self.qps.values():
            qp.to_error()
        for qp in self.qps.values():
            if qp.thread.is_alive() and qp.thread is not threading.current_thread():
                qp.thread.join(timeout=5)
            with _registry_lock:
                _qps.pop(qp.qpn, None)
