"""The RDMA lane's decisions without a NIC: port and GID choice, QP info, WRITE planning, send-queue slots, SGE lists."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smartgen.lanes.backends import unavailable
from smartgen.lanes.rdma.handshake import QpInfo, rtr_settings
from smartgen.lanes.rdma.plan import QueueLimits, SendQueue, Sge, chunk_sges, plan_writes, reply_sizes
from smartgen.lanes.rdma.select import Choice, GidInfo, PortInfo, choose_gid, choose_port, negotiate_mtu
from smartgen.lanes.transport import Segment

ACTIVE, DOWN, IB, ETH = 4, 1, 1, 2


def test_port_choice_takes_the_one_sensible_answer_or_says_why_not():
    with pytest.raises(RuntimeError, match="no RDMA device"):
        choose_port([])
    one = [PortInfo("mlx5_0", 1, ACTIVE, ETH, 5), PortInfo("mlx5_0", 2, DOWN, ETH, 5)]
    assert choose_port(one) == Choice("mlx5_0", 1)
    two = one + [PortInfo("rxe0", 1, ACTIVE, ETH, 3)]
    with pytest.raises(RuntimeError, match="--rdma-device"):
        choose_port(two)
    assert choose_port(two, device="rxe0") == Choice("rxe0", 1)
    with pytest.raises(RuntimeError, match="no active RDMA port"):
        choose_port(two, device="mlx5_0", port=2)
    with pytest.raises(RuntimeError, match="this machine has mlx5_0, rxe0"):
        choose_port(two, device="mlx4_0")


def test_gid_choice_prefers_roce_v2_ipv4_and_zero_on_infiniband():
    gids = [
        GidInfo(0, "fe80:0000:0000:0000:0202:c9ff:fe00:0001", 0),
        GidInfo(1, "fe80:0000:0000:0000:0202:c9ff:fe00:0001", 1),
        GidInfo(2, "0000:0000:0000:0000:0000:ffff:0a00:0001", 0),
        GidInfo(3, "0000:0000:0000:0000:0000:ffff:0a00:0001", 1),
        GidInfo(4, "0000:0000:0000:0000:0000:0000:0000:0000", 0),
    ]
    assert choose_gid(gids, ETH) == 3
    assert choose_gid(gids, IB) == 0
    assert choose_gid(gids, ETH, index=2) == 2
    with pytest.raises(RuntimeError, match="GID index 4 is empty"):
        choose_gid(gids, ETH, index=4)
    with pytest.raises(RuntimeError, match="pass --gid-index"):
        choose_gid([GidInfo(0, gids[0].gid, 0), GidInfo(1, "fe80::2", 0)], ETH)
    assert negotiate_mtu(5, 3) == 3  # 4096 here, 1024 there: 1024


def test_queue_pair_info_round_trips_and_both_ends_agree():
    a = QpInfo(0x11, 7, 0, "fe80::1", 1, 5, ETH)
    b = QpInfo(0x22, 9, 0, "fe80::2", 3, 3, ETH)
    assert QpInfo.from_meta(a.to_meta()) == a
    at_a, at_b = rtr_settings(a, b), rtr_settings(b, a)
    assert at_a["dest_qp_num"] == b.qpn and at_b["dest_qp_num"] == a.qpn
    assert at_a["rq_psn"] == at_b["sq_psn"] == b.psn
    assert at_a["path_mtu"] == at_b["path_mtu"] == 3 and at_a["is_global"]
    with pytest.raises(ValueError):
        QpInfo.from_meta({**a.to_meta(), "qpn": 2**24})
    with pytest.raises(ValueError, match="incomplete"):
        QpInfo.from_meta({"qpn": 1})


@given(
    st.lists(st.integers(1, 10_000), min_size=1, max_size=300),
    st.integers(2, 64),
    st.integers(1, 40),
    st.integers(1, 16),
    st.integers(512, 4096),
)
def test_write_plan_keeps_order_bounds_batches_and_signals_each_batch_end(lengths, depth, every, max_post, max_msg):
    limits = QueueLimits(depth, 4, max_msg, every, max_post)
    segments, dst = [], 0
    for length in lengths:
        segments.append(Segment(10**6 + dst, 5 * 10**6 + dst, length, 7, 9))
        dst += length
    batches = plan_writes(segments, limits, first_wr_id=100)
    wrs = [wr for batch in batches for wr in batch]
    assert [wr.wr_id for wr in wrs] == list(range(100, 100 + len(wrs)))
    assert all(wr.sge.length <= max_msg and wr.sge.lkey == 7 and wr.rkey == 9 for wr in wrs)
    assert sum(wr.sge.length for wr in wrs) == dst
    assert [wr.remote_addr - 5 * 10**6 for wr in wrs] == [wr.sge.addr - 10**6 for wr in wrs]  # in order, in place
    for batch in batches:
        assert len(batch) <= min(max_post, limits.signal_interval) <= depth
        assert batch[-1].signaled and not any(wr.signaled for wr in batch[:-1])


def test_send_queue_never_overflows_and_a_completion_retires_everything_before_it():
    limits = QueueLimits(max_send_wr=8, max_sge=4, signal_every=64, max_post=32)
    queue = SendQueue(limits.max_send_wr)
    batches = plan_writes([Segment(i, i, 1, 1, 1) for i in range(20)], limits)
    assert limits.batch_size == 4  # the queue depth caps the signalling interval at half of it
    posted = []
    for batch in batches:
        while not queue.fits(batch):
            assert queue.completed(posted.pop(0)) == 4
        queue.posted(batch)
        posted.append(batch[-1].wr_id)
    assert queue.in_use <= 8
    with pytest.raises(RuntimeError, match="overflow"):
        queue.posted(plan_writes([Segment(i, i, 1, 1, 1) for i in range(12)], QueueLimits(16, 4, max_post=16))[0])


def test_fetch_scatter_lists_merge_rows_and_respect_max_sge():
    entry = 256  # K (or V) bytes of one token
    rows = [(10_000 * r, n) for r, n in enumerate([3, 0, 5, 1, 2, 4, 0, 1])]  # (row start, remote entries first)
    sges = [Sge(addr, n * entry, 1) for addr, n in rows]
    chunks = chunk_sges(sges, max_sge=3)
    assert all(len(c) <= 3 for c in chunks) and sum(reply_sizes(chunks)) == 16 * entry
    assert [s.addr for c in chunks for s in c] == [addr for addr, n in rows if n]
    adjacent = chunk_sges([Sge(0, 8, 1), Sge(8, 8, 1), Sge(16, 8, 2)], max_sge=1)
    assert adjacent == [[Sge(0, 16, 1)], [Sge(16, 8, 2)]]


def test_rdma_device_is_listed_where_one_exists():
    reason = unavailable("rdma")
    if reason:
        pytest.skip(f"needs an RDMA device and pyverbs: {reason}")
    from smartgen.lanes.rdma.device import describe

    rows = describe()
    assert rows and all(row["gids"] for row in rows)
