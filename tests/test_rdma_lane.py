"""The RDMA lane's messages and in-place fetch replies, over software verbs endpoints (tests/softverbs.py).

The lane's own logic (fragments, bounce buffers, reply plans, scatter lists, discards) runs here
as it would on a NIC; only the verbs calls are replaced. See docs/lanes.md for running the lane on
a device.
"""

import threading
import time

import pytest
import torch
from conftest import SOFT_RDMA, make_link, wait_until

from smartgen.engine.layout import KVLayout
from smartgen.engine.pool import PoolGeometry
from smartgen.lanes import Message, MessageKind, WriteOp
from smartgen.lanes.base import Landing
from smartgen.lanes.rdma.messaging import FrameAssembler, fragments, frame_parts
from smartgen.lanes.rdma.plan import Sge
from smartgen.lanes.rdma.replies import check_chunk_sizes, landing_chunks


@pytest.fixture
def link():
    prefill, decode = make_link(SOFT_RDMA)
    yield prefill, decode
    prefill.close()
    decode.close()


def _fetch(request_id: str, fetch_id: int) -> Message:
    return Message(MessageKind.FETCH, request_id, {"layer": 0, "fetch_id": fetch_id}, {"positions": torch.arange(3)})


def _reply(request_id: str, fetch_id: int, k: torch.Tensor, v: torch.Tensor) -> Message:
    return Message(MessageKind.FETCH_REPLY, request_id, {"fetch_id": fetch_id}, {"k": k, "v": v})


def _answer(prefill, k: torch.Tensor, v: torch.Tensor) -> Message:
    """What the prefill end received (a FETCH), answered with k and v."""
    fetch = prefill.control.recv(timeout=10)
    assert fetch is not None and fetch.kind == MessageKind.FETCH
    prefill.control.send(_reply(fetch.request_id, fetch.meta["fetch_id"], k, v))
    return fetch


def test_frames_cut_into_fragments_join_again_whatever_the_cuts():
    messages = [
        Message(MessageKind.IDLE, f"r{i}", {"layer": i}, {"hints": torch.arange(i * 1000, dtype=torch.int64)})
        for i in range(4)
    ]
    stream = b"".join(bytes(part) for m in messages for part in frame_parts(m))
    for size in (1, 7, 4096, len(stream)):
        assembler = FrameAssembler()
        got = [m for start in range(0, len(stream), size) for m in assembler.feed(stream[start : start + size])]
        assert [(m.request_id, m.meta) for m in got] == [(m.request_id, m.meta) for m in messages]
        assert all(torch.equal(a.payload["hints"], b.payload["hints"]) for a, b in zip(got, messages))
        assert assembler.pending_bytes == 0
    assert fragments(10, 4) == [4, 4, 2] and fragments(0, 4) == []
    with pytest.raises(ConnectionError, match="WRITE frame"):
        from smartgen.lanes.wire import FrameType, header_bytes

        list(FrameAssembler().feed(header_bytes(FrameType.WRITE, "r", {}, 0)))


def test_landing_chunks_merge_neighbours_and_respect_max_sge_and_message_size():
    region = torch.zeros(1000, dtype=torch.uint8)
    base = region.data_ptr()
    ranges = [(region, 0, 10), (region, 10, 10), (region, 40, 5), (region, 60, 5), (region, 80, 30), (region, 200, 1)]
    chunks, sizes = landing_chunks(ranges, lambda r: (r.data_ptr(), 7), max_sge=2, max_msg_bytes=2**31)
    assert chunks == [[Sge(base, 20, 7), Sge(base + 40, 5, 7)], [Sge(base + 60, 5, 7), Sge(base + 80, 30, 7)],
                      [Sge(base + 200, 1, 7)]]  # fmt: skip
    assert sizes == [25, 35, 1]
    chunks, sizes = landing_chunks([(region, 0, 100)], lambda r: (r.data_ptr(), 7), max_sge=4, max_msg_bytes=32)
    assert sizes == [32, 32, 32, 4] and all(len(c) == 1 for c in chunks)
    with pytest.raises(ValueError, match="outside"):
        landing_chunks([(region, 990, 20)], lambda r: (r.data_ptr(), 7), 4, 2**31)
    assert check_chunk_sizes([1, 2]) == [1, 2]
    for bad in ([], [0], [1.5], "12", [True], [1] * 70_000):
        with pytest.raises(ValueError):
            check_chunk_sizes(bad)


def test_messages_longer_than_a_bounce_buffer_arrive_whole_and_in_order_with_the_writes(link):
    prefill, decode = link
    region = torch.zeros(64, dtype=torch.uint8)
    decode.push.register_region("x", region)
    decode.push.accept("r")
    big = torch.randn(30_000)  # 120 kB through 4 KiB bounce buffers: 30 fragments
    for i in range(3):
        prefill.push.post_writes(
            "r", {"s": torch.full((8,), i + 1, dtype=torch.uint8)}, [WriteOp("s", "x", 0, 8 * i, 8)], tag="t"
        )
        prefill.push.send(Message(MessageKind.METADATA, "r", {"i": i}, {"t": big * i}))
    for i in range(3):
        message = decode.push.recv(timeout=10)
        assert message is not None and message.meta == {"i": i} and torch.equal(message.payload["t"], big * i)
        assert int(region[8 * i]) == i + 1  # the write posted before it is in
    decode.control.send(Message(MessageKind.IDLE, "r", {"layer": 3}))
    assert prefill.control.recv(timeout=10).meta == {"layer": 3}


def test_a_fetch_reply_lands_in_the_rows_its_landing_names(link):
    prefill, decode = link
    k_region, v_region = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    ranges = [(0, 16), (64, 48), (512, 16), (1024, 32), (2048, 16), (4000, 16)]  # 6 runs > max_sge 4
    landing = Landing("r", [(k_region, o, n) for o, n in ranges] + [(v_region, o, n) for o, n in ranges])
    k = torch.arange(144, dtype=torch.uint8)
    v = torch.arange(144, dtype=torch.uint8) + 100
    decode.control.send(_fetch("r", 1), landing=landing)
    fetch = _answer(prefill, k, v)
    assert sum(fetch.meta["reply_chunks"]) == 288
    reply = decode.control.recv(timeout=10)
    assert reply.kind == MessageKind.FETCH_REPLY and reply.meta == {"fetch_id": 1, "landed": 288}
    assert reply.payload == {}
    done = 0
    for offset, length in ranges:
        assert torch.equal(k_region[offset : offset + length], k[done : done + length])
        assert torch.equal(v_region[offset : offset + length], v[done : done + length])
        done += length
    assert int(k_region.sum()) == int(k.sum()) and int(v_region.sum()) == int(v.to(torch.int64).sum())
    assert decode.control.transport.endpoint.max_recv_sges <= 4  # the device's max_sge per RECV


def test_a_reply_in_more_recvs_than_the_receive_queue_holds_lands_whole(link):
    prefill, decode = link
    region = torch.zeros(8 * 600, dtype=torch.uint8)
    ranges = [(region, 8 * i, 4) for i in range(600)]  # 600 runs, 4 SGEs per RECV: 150 RECVs, queue depth 64
    decode.control.send(_fetch("r", 1), landing=Landing("r", ranges))
    data = torch.arange(2400, dtype=torch.int64).remainder(251).add(1).to(torch.uint8)
    _answer(prefill, data[:1200], data[1200:])
    reply = decode.control.recv(timeout=10)
    assert reply.meta["landed"] == 2400
    assert torch.equal(region.view(600, 8)[:, :4].reshape(-1), data) and not bool(region.view(600, 8)[:, 4:].any())


def test_a_reply_nobody_waits_for_is_dropped_and_the_next_one_still_lands(link):
    prefill, decode = link
    region = torch.zeros(256, dtype=torch.uint8)
    decode.control.send(_fetch("gone", 1), landing=Landing("gone", [(region, 0, 64), (region, 64, 64)]))
    decode.control.send(_fetch("alive", 2), landing=Landing("alive", [(region, 128, 64), (region, 192, 64)]))
    decode.control.drop_landings("gone")  # that request ended: its slot may be reused
    _answer(prefill, torch.full((64,), 1, dtype=torch.uint8), torch.full((64,), 2, dtype=torch.uint8))
    _answer(prefill, torch.full((64,), 3, dtype=torch.uint8), torch.full((64,), 4, dtype=torch.uint8))
    reply = decode.control.recv(timeout=10)
    assert reply.request_id == "alive" and reply.meta["landed"] == 128
    assert not bool(region[:128].any())  # the dropped reply went to the discard buffer
    assert bool((region[128:192] == 3).all()) and bool((region[192:] == 4).all())
    assert decode.control.recv(timeout=0.2) is None


def test_a_reply_of_another_size_than_asked_arrives_with_its_payload(link):
    prefill, decode = link
    region = torch.zeros(64, dtype=torch.uint8)
    decode.control.send(_fetch("r", 5), landing=Landing("r", [(region, 0, 32), (region, 32, 32)]))
    _answer(prefill, torch.ones(10, dtype=torch.uint8), torch.ones(10, dtype=torch.uint8))  # not the 64 bytes asked
    reply = decode.control.recv(timeout=10)
    assert "landed" not in reply.meta and reply.payload["k"].numel() == 10
    assert not bool(region.any())


def test_messages_behind_a_landing_reply_keep_their_order(link):
    prefill, decode = link
    region = torch.zeros(2**20, dtype=torch.uint8)
    decode.control.send(_fetch("r", 1), landing=Landing("r", [(region, 0, 2**19), (region, 2**19, 2**19)]))
    fetch = prefill.control.recv(timeout=10)
    prefill.control.send(_reply("r", 1, torch.ones(2**19, dtype=torch.uint8), torch.ones(2**19, dtype=torch.uint8)))
    prefill.control.send(Message(MessageKind.ERROR, "r", {"reason": "after the reply"}))
    kinds = [decode.control.recv(timeout=10).kind for _ in range(2)]
    assert fetch.meta["fetch_id"] == 1 and kinds == [MessageKind.FETCH_REPLY, MessageKind.ERROR]
    assert int(region.sum()) == 2**20


def test_dropping_landings_waits_for_a_reply_landing_now(link):
    prefill, decode = link
    transport = prefill.control.transport
    release, real_send = threading.Event(), transport.send

    def held_send(role, parts, sizes=None):
        if sizes is not None:  # the reply's bytes, after its header: hold them on the wire
            release.wait(10)
        real_send(role, parts, sizes)

    transport.send = held_send
    region = torch.zeros(2**16, dtype=torch.uint8)
    decode.control.send(_fetch("r", 1), landing=Landing("r", [(region, 0, 2**15), (region, 2**15, 2**15)]))
    _answer(prefill, torch.ones(2**15, dtype=torch.uint8), torch.ones(2**15, dtype=torch.uint8))
    lane = decode.control
    wait_until(lambda: lane._scattering.get("r"), 10, "the reply's RECVs to be posted")
    dropper = threading.Thread(target=lane.drop_landings, args=("r",))
    dropper.start()
    dropper.join(0.3)
    assert dropper.is_alive(), "drop_landings returned while a reply was still to land in the request's rows"
    release.set()
    dropper.join(10)
    assert not dropper.is_alive() and int(region.sum()) == 2**16 and not lane.closed


def test_a_reply_that_never_finishes_landing_closes_the_lane_before_its_rows_are_reused(link):
    prefill, decode = link
    transport, real_send = prefill.control.transport, prefill.control.transport.send
    stuck = threading.Event()

    def stuck_send(role, parts, sizes=None):
        if sizes is not None:
            stuck.wait(10)  # the reply's bytes never leave
        real_send(role, parts, sizes)

    transport.send = stuck_send
    region = torch.zeros(64, dtype=torch.uint8)
    decode.control.send(_fetch("r", 1), landing=Landing("r", [(region, 0, 32), (region, 32, 32)]))
    _answer(prefill, torch.ones(32, dtype=torch.uint8), torch.ones(32, dtype=torch.uint8))
    lane = decode.control
    wait_until(lambda: lane._scattering.get("r"), 10, "the reply's RECVs to be posted")
    lane.confirm_timeout_s = 0.3
    lane.drop_landings("r")
    assert lane.closed and lane._verbs_closed.is_set() and "did not finish landing" in lane.error
    stuck.set()
    time.sleep(0.1)
    assert not bool(region.any())


def test_a_prefill_end_closing_mid_reply_breaks_the_decode_end_without_hanging():
    prefill, decode = make_link(SOFT_RDMA, gbps=0.1)
    try:
        region = torch.zeros(2**20, dtype=torch.uint8)
        decode.control.send(_fetch("r", 1), landing=Landing("r", [(region, 0, 2**19), (region, 2**19, 2**19)]))
        _answer(prefill, torch.ones(2**19, dtype=torch.uint8), torch.ones(2**19, dtype=torch.uint8))
        time.sleep(0.02)
        prefill.close()
        wait_until(lambda: decode.control.closed, 10, "the decode end to notice")
        started = time.monotonic()
        threading.Thread(target=decode.control.drop_landings, args=("r",), daemon=True).start()
        assert decode.control.recv(timeout=1) is None and time.monotonic() - started < 5
    finally:
        prefill.close()
        decode.close()


def test_entry_ranges_are_one_range_per_run_of_consecutive_entries():
    layout = KVLayout(2, 2, 4)  # 2 layers, 2 KV heads, head_dim 4, fp32: an entry is 16 bytes
    geometry = PoolGeometry(layout, 3, 10)
    base = geometry.kv_offset(1, 2, 0)
    ranges = geometry.entry_ranges(1, 2, torch.tensor([0, 1, 2, 5, 7, 8]))
    assert ranges == [(base, 48), (base + 80, 16), (base + 112, 32)]
    assert geometry.entry_ranges(0, 0, torch.tensor([], dtype=torch.int64)) == []
