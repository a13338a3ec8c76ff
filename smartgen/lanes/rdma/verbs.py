"""Thin pyverbs calls for one RDMA endpoint: open, register, two RC queue pairs (INIT/RTR/RTS), post, poll.

Everything that decides something lives in plan.py, select.py, handshake.py and the lane; this file
only translates their results into verbs (the `Endpoint` protocol of endpoint.py). It needs an
RDMA device to run (a NIC or a Soft-RoCE link); see docs/lanes.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from smartgen.lanes.extras import require
from smartgen.lanes.rdma.device import PYVERBS_HINT, list_gids, list_ports
from smartgen.lanes.rdma.gpu_memory import register_device_memory
from smartgen.lanes.rdma.handshake import QpInfo, QpRole, random_psn, rtr_settings
from smartgen.lanes.rdma.plan import QueueLimits, Sge, WriteWR
from smartgen.lanes.rdma.select import choose_gid, choose_port
from smartgen.lanes.transport import TransportError

__all__ = ["VerbsEndpoint"]

MIN_RNR_TIMER = 1  # 0.01 ms: a fetch reply's SEND may arrive just before its scatter RECVs are posted


def _verbs() -> dict[str, Any]:
    names = ("device", "pd", "cq", "qp", "mr", "wr", "addr", "enums")
    return {name: require(f"pyverbs.{name}", "rdma", PYVERBS_HINT) for name in names}


class VerbsEndpoint:
    """A protection domain, a send CQ, a receive CQ and two RC queue pairs (MAIN, REPLY) on the chosen port."""

    def __init__(
        self,
        device: str | None = None,
        port: int | None = None,
        gid_index: int | None = None,
        queue_depth: int = 512,
        signal_every: int = 64,
    ) -> None:
        v = self.v = _verbs()
        e = v["enums"]
        choice = choose_port(list_ports(), device, port)
        self.port = choice.port
        self.ctx = v["device"].Context(name=choice.device)
        attr = self.ctx.query_device()
        port_attr = self.ctx.query_port(self.port)
        self.gid_index = choose_gid(list_gids(self.ctx, self.port), port_attr.link_layer, gid_index)
        depth = min(queue_depth, attr.max_qp_wr)
        max_sge = min(attr.max_sge, 30)
        self.limits = QueueLimits(depth, max_sge, port_attr.max_msg_sz, signal_every)
        self.pd = v["pd"].PD(self.ctx)
        self.send_cq = v["cq"].CQ(self.ctx, min(4 * depth, attr.max_cqe))
        self.recv_cq = v["cq"].CQ(self.ctx, min(4 * depth, attr.max_cqe))
        cap = v["qp"].QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=max_sge, max_recv_sge=max_sge)
        self.qps = {
            role: v["qp"].QP(
                self.pd,
                v["qp"].QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.send_cq, rcq=self.recv_cq, cap=cap, sq_sig_all=0),
            )
            for role in QpRole
        }
        gid = str(self.ctx.query_gid(self.port, self.gid_index))
        self._infos = {
            role: QpInfo(
                qp.qp_num,
                random_psn(),
                port_attr.lid,
                gid,
                self.gid_index,
                port_attr.active_mtu,
                port_attr.link_layer,
            )
            for role, qp in self.qps.items()
        }
        self.access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE

    def qp_infos(self) -> dict[QpRole, QpInfo]:
        return dict(self._infos)

    def register(self, addr: int, length: int, device_index: int | None = None) -> Any:
        if device_index is not None:  # CUDA memory: the first GPUDirect RDMA route this host has
            return register_device_memory(self.pd, self.v["mr"], addr, length, self.access, device_index)
        return self.v["mr"].MR(self.pd, length, self.access, address=addr)

    def connect(self, remote: dict[QpRole, QpInfo]) -> None:
        for role, qp in self.qps.items():
            self._connect_qp(qp, self._infos[role], remote[role])

    def _connect_qp(self, qp: Any, local: QpInfo, remote: QpInfo) -> None:
        """RESET -> INIT -> RTR -> RTS with the negotiated MTU and the peer's QPN, PSN and GID."""
        v, e, s = self.v, self.v["enums"], rtr_settings(local, remote)
        qp_mod = v["qp"]
        attr = qp_mod.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=self.port)
        attr.qp_access_flags = self.access
        qp.to_init(attr)
        attr = qp_mod.QPAttr(qp_state=e.IBV_QPS_RTR, port_num=self.port, path_mtu=s["path_mtu"])
        attr.dest_qp_num, attr.rq_psn = s["dest_qp_num"], s["rq_psn"]
        attr.max_dest_rd_atomic, attr.min_rnr_timer = 1, MIN_RNR_TIMER
        route = v["addr"].GlobalRoute(dgid=v["addr"].GID(s["dgid"]), sgid_index=s["sgid_index"])
        attr.ah_attr = v["addr"].AHAttr(dlid=s["dlid"], is_global=int(s["is_global"]), port_num=self.port, gr=route)
        qp.to_rtr(attr)
        attr = qp_mod.QPAttr(qp_state=e.IBV_QPS_RTS)
        # rnr_retry 7: retry for as long as the receiver has no RECV posted (flow control, not an error)
        attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = s["sq_psn"], 14, 7, 7, 1
        qp.to_rts(attr)

    def post_writes(self, batch: Sequence[WriteWR]) -> None:
        """One doorbell: the batch as a linked list of WRITEs in a single ibv_post_send."""
        wr_mod, e = self.v["wr"], self.v["enums"]
        head = None
        for wr in reversed(batch):
            flags = e.IBV_SEND_SIGNALED if wr.signaled else 0
            sge = wr_mod.SGE(wr.sge.addr, wr.sge.length, wr.sge.lkey)
            kwargs: dict[str, Any] = {"next_wr": head} if head is not None else {}
            send = wr_mod.SendWR(
                wr_id=wr.wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=flags, **kwargs
            )
            send.set_wr_rdma(wr.rkey, wr.remote_addr)
            head = send
        if head is not None:
            self.qps[QpRole.MAIN].post_send(head)

    def post_recvs(self, role: QpRole, recvs: Sequence[tuple[int, Sequence[Sge]]]) -> None:
        """RECVs in order, one scatter list each (a fetch reply lands row by row in the pool)."""
        wr_mod = self.v["wr"]
        qp = self.qps[role]
        for wr_id, chunk in recvs:
            sges = [wr_mod.SGE(s.addr, s.length, s.lkey) for s in chunk]
            qp.post_recv(wr_mod.RecvWR(wr_id=wr_id, num_sge=len(sges), sg=sges))

    def post_send(self, role: QpRole, sges: Sequence[Sge], wr_id: int) -> None:
        """One signalled SEND gathering `sges` (a message fragment, or one chunk of a fetch reply)."""
        wr_mod, e = self.v["wr"], self.v["enums"]
        items = [wr_mod.SGE(s.addr, s.length, s.lkey) for s in sges]
        self.qps[role].post_send(
            wr_mod.SendWR(
                wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=len(items), sg=items, send_flags=e.IBV_SEND_SIGNALED
            )
        )

    def _poll(self, cq: Any, max_entries: int) -> list[Any]:
        count, completions = cq.poll(max_entries)
        done = completions[:count]
        for wc in done:
            if wc.status != self.v["enums"].IBV_WC_SUCCESS:
                raise TransportError(f"RDMA work request {wc.wr_id} failed: status {wc.status}")
        return done

    def poll_send(self, max_entries: int = 16) -> list[int]:
        return [wc.wr_id for wc in self._poll(self.send_cq, max_entries)]

    def poll_recv(self, max_entries: int = 16) -> list[tuple[int, int]]:
        return [(wc.wr_id, wc.byte_len) for wc in self._poll(self.recv_cq, max_entries)]

    def close(self) -> None:
        for qp in getattr(self, "qps", {}).values():
            qp.close()
        for name in ("send_cq", "recv_cq", "pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
