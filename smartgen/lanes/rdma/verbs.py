"""Thin pyverbs calls for one RC queue pair: open, register, connect (INIT/RTR/RTS), post, poll.

Everything that decides something lives in plan.py, select.py and handshake.py; this file
only translates their results into verbs. It needs an RDMA device to run (a NIC or a
Soft-RoCE link); see docs/lanes.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from smartgen.lanes.extras import require
from smartgen.lanes.rdma.device import PYVERBS_HINT, list_gids, list_ports
from smartgen.lanes.rdma.handshake import QpInfo, random_psn, rtr_settings
from smartgen.lanes.rdma.plan import QueueLimits, Sge, WriteWR
from smartgen.lanes.rdma.select import choose_gid, choose_port
from smartgen.lanes.transport import TransportError

__all__ = ["VerbsEndpoint"]


def _verbs() -> dict[str, Any]:
    names = ("device", "pd", "cq", "qp", "mr", "wr", "addr", "enums")
    return {name: require(f"pyverbs.{name}", "rdma", PYVERBS_HINT) for name in names}


class VerbsEndpoint:
    """A protection domain, one completion queue and one RC queue pair on the chosen port."""

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
        self.cq = v["cq"].CQ(self.ctx, min(2 * depth, attr.max_cqe))
        cap = v["qp"].QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=max_sge, max_recv_sge=max_sge)
        init = v["qp"].QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        self.qp = v["qp"].QP(self.pd, init)
        self.info = QpInfo(
            self.qp.qp_num,
            random_psn(),
            port_attr.lid,
            str(self.ctx.query_gid(self.port, self.gid_index)),
            self.gid_index,
            port_attr.active_mtu,
            port_attr.link_layer,
        )
        self.access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE

    def register(self, addr: int, length: int) -> Any:
        return self.v["mr"].MR(self.pd, length, self.access, address=addr)

    def connect(self, remote: QpInfo) -> None:
        """RESET -> INIT -> RTR -> RTS with the negotiated MTU and the peer's QPN, PSN and GID."""
        v, e, s = self.v, self.v["enums"], rtr_settings(self.info, remote)
        qp_mod = v["qp"]
        attr = qp_mod.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=self.port)
        attr.qp_access_flags = self.access
        self.qp.to_init(attr)
        attr = qp_mod.QPAttr(qp_state=e.IBV_QPS_RTR, port_num=self.port, path_mtu=s["path_mtu"])
        attr.dest_qp_num, attr.rq_psn = s["dest_qp_num"], s["rq_psn"]
        attr.max_dest_rd_atomic, attr.min_rnr_timer = 1, 12
        route = v["addr"].GlobalRoute(dgid=v["addr"].GID(s["dgid"]), sgid_index=s["sgid_index"])
        attr.ah_attr = v["addr"].AHAttr(dlid=s["dlid"], is_global=int(s["is_global"]), port_num=self.port, gr=route)
        self.qp.to_rtr(attr)
        attr = qp_mod.QPAttr(qp_state=e.IBV_QPS_RTS)
        attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = s["sq_psn"], 14, 7, 7, 1
        self.qp.to_rts(attr)

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
            self.qp.post_send(head)

    def post_recvs(self, chunks: Sequence[Sequence[Sge]], first_wr_id: int) -> None:
        """One RECV per scatter list (a fetch reply lands row by row in the reordered pool rows)."""
        wr_mod = self.v["wr"]
        for i, chunk in enumerate(chunks):
            sges = [wr_mod.SGE(s.addr, s.length, s.lkey) for s in chunk]
            self.qp.post_recv(wr_mod.RecvWR(wr_id=first_wr_id + i, num_sge=len(sges), sg=sges))

    def post_send(self, sges: Sequence[Sge], wr_id: int) -> None:
        """One signalled SEND gathering `sges` (a fetch request, or one chunk of a reply)."""
        wr_mod, e = self.v["wr"], self.v["enums"]
        items = [wr_mod.SGE(s.addr, s.length, s.lkey) for s in sges]
        self.qp.post_send(
            wr_mod.SendWR(
                wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=len(items), sg=items, send_flags=e.IBV_SEND_SIGNALED
            )
        )

    def poll(self, max_entries: int = 16) -> list[int]:
        """wr_ids of the completions ready now; raises TransportError on a failed one."""
        count, completions = self.cq.poll(max_entries)
        done = []
        for wc in completions[:count]:
            if wc.status != self.v["enums"].IBV_WC_SUCCESS:
                raise TransportError(f"RDMA work request {wc.wr_id} failed: status {wc.status}")
            done.append(wc.wr_id)
        return done

    def close(self) -> None:
        for name in ("qp", "cq", "pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
