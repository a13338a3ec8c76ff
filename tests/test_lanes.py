"""The lane contract on every lane this machine has: coalescing, ordering, revocation, pacing, shutdown."""

import threading
import time

import pytest
import torch
from conftest import make_link

from smartgen.engine.descriptors import block_runs, block_write_ops, held_blocks, token_runs
from smartgen.engine.layout import KVLayout
from smartgen.engine.pool import DecodePool, PrefillStore
from smartgen.lanes import Message, MessageKind, Pacer, WriteOp, coalesce


def test_coalesce_merges_only_continuing_neighbours():
    ops = [
        WriteOp("k", "k", 0, 100, 10),
        WriteOp("k", "k", 10, 110, 5),
        WriteOp("v", "v", 15, 115, 5),
        WriteOp("k", "k", 20, 120, 5),
    ]
    assert coalesce(ops) == [
        WriteOp("k", "k", 0, 100, 15),
        WriteOp("v", "v", 15, 115, 5),
        WriteOp("k", "k", 20, 120, 5),
    ]
    # adjacent in the source but not in the destination: kept apart
    assert len(coalesce([WriteOp("k", "k", 0, 0, 4), WriteOp("k", "k", 4, 8, 4)])) == 2


def test_block_runs_and_a_whole_layer_is_three_descriptors():
    assert block_runs(torch.tensor([5, 1, 2, 3, 7, 8])) == [(1, 4), (5, 6), (7, 9)]
    layout = KVLayout(4, 2, 8, num_blocks=16)
    pool = DecodePool(layout, num_slots=2, max_tokens=128)
    store = PrefillStore(layout)
    entry = store.open("r", 100)
    ops, kv_bytes = block_write_ops(pool.geometry, entry, 1, [(2, torch.arange(16))])
    assert [op.dst for op in ops] == ["k", "v", "mask"]
    assert kv_bytes == 2 * 100 * layout.token_bytes
    # data before mask, for every batch
    ops, _ = block_write_ops(pool.geometry, entry, 1, [(2, torch.tensor([0, 5])), (3, torch.tensor([9]))])
    kinds = [op.dst == "mask" for op in ops]
    assert kinds == sorted(kinds)


def test_held_tokens_are_never_pushed_again():
    """A request opened again after its prefill node was lost: tokens the decode node holds get no descriptor."""
    layout = KVLayout(4, 2, 8, num_blocks=16)
    pool = DecodePool(layout, num_slots=2, max_tokens=128)
    entry = PrefillStore(layout).open("r", 100)
    held = torch.zeros(4, 100, dtype=torch.bool)
    held[2, 10:30] = True  # blocks of layer 2 partly held
    held[3] = True  # layer 3 wholly held
    ops, kv_bytes = block_write_ops(pool.geometry, entry, 1, [(2, torch.arange(16)), (3, torch.arange(16))], ~held)
    masks = [op for op in ops if op.dst == "mask"]
    first = pool.geometry.mask_offset(2, 1, 0)
    heads = layout.num_kv_heads  # a mask byte per token and KV head
    assert [(op.dst_offset - first, op.length) for op in masks] == [(0, 10 * heads), (30 * heads, 70 * heads)]
    assert kv_bytes == 2 * 80 * layout.token_bytes
    blocks = held_blocks(held, 16)  # 100 tokens in 16 blocks: blocks 2 and 3 (tokens 12-24) lie inside 10:30
    assert blocks[3].all() and blocks[2].nonzero().flatten().tolist() == [2, 3] and not blocks[:2].any()
    assert token_runs(~held[2, 5:40]) == [(0, 5), (25, 35)] and token_runs(torch.ones(3, dtype=torch.bool)) == [(0, 3)]


@pytest.fixture
def link(lane_kind):
    prefill, decode = make_link(lane_kind)
    yield prefill, decode
    prefill.close()
    decode.close()


def test_writes_land_in_order_and_messages_follow_them(link):
    prefill, decode = link
    a, b = prefill.push, decode.push
    region = torch.zeros(64, dtype=torch.uint8)
    b.register_region("x", region)
    b.accept("r1")
    src = torch.arange(1, 33, dtype=torch.uint8)
    seen = []

    for i in range(20):
        a.post_writes("r1", {"s": src}, [WriteOp("s", "x", 0, i, 32)], tag="t")
    a.send(Message(MessageKind.FIRST_TOKEN, "r1", {"token": 7}))
    message = b.recv(timeout=5)
    seen.append(region.clone())
    assert message.kind == MessageKind.FIRST_TOKEN and message.meta["token"] == 7
    # the message was posted after the writes, so all of them are in when it arrives
    assert torch.equal(seen[0][19:51], src)
    assert a.counters.snapshot()["bytes_by_tag"]["t"] == 20 * 32


def test_a_write_outside_its_requests_slot_never_lands_on_any_lane(link):
    """Every lane checks each descriptor against the slot the owner accepted the request with: TCP and in-process
    on the owner's side, one-sided lanes (Mooncake, NIXL, RDMA) on the writer's, before the transport moves a byte."""
    prefill, decode = link
    region = torch.zeros(256, dtype=torch.uint8)
    decode.push.register_region("k", region)
    decode.push.accept("r", {"k": [(64, 128)]})
    source = torch.full((256,), 9, dtype=torch.uint8)
    for offset, length in ((0, 8), (124, 8), (252, 8), (128, 1)):  # before, straddling, past the region, just after
        done = prefill.push.post_writes("r", {"s": source}, [WriteOp("s", "k", 0, offset, length)], tag="t")
        assert done.wait(30) and not done.applied, (offset, length)
    assert not bool(region.any())
    done = prefill.push.post_writes("r", {"s": source}, [WriteOp("s", "k", 0, 64, 64)], tag="t")
    assert done.wait(30) and done.applied and bool((region[64:128] == 9).all()) and not bool(region[128:].any())


def test_a_mask_write_never_lands_before_its_data(link):
    prefill, decode = link
    kv = torch.zeros(4 * 2**20, dtype=torch.uint8)
    mask = torch.zeros(64, dtype=torch.uint8)
    decode.push.register_region("kv", kv)
    decode.push.register_region("mask", mask)
    decode.push.accept("r")
    data = torch.full((kv.numel(),), 7, dtype=torch.uint8)
    ones = torch.ones(64, dtype=torch.uint8)
    for i in range(8):  # each batch: 4 MiB of data, then the block's mask byte; watch for a mask without data
        kv.zero_()
        ops = [WriteOp("d", "kv", 0, 0, kv.numel()), WriteOp("o", "mask", 0, i, 1)]
        done = prefill.push.post_writes("r", {"d": data, "o": ones}, ops, tag="t")
        while not done.done():
            if mask[i]:
                assert int(kv[-1]) == 7, "the mask landed before the end of its data"
        assert done.applied and int(mask[i]) == 1 and int(kv.min()) == 7


def test_revoked_requests_never_land(link):
    prefill, decode = link
    a, b = prefill.push, decode.push
    region = torch.zeros(16, dtype=torch.uint8)
    b.register_region("x", region)
    src = torch.full((16,), 9, dtype=torch.uint8)
    done = a.post_writes("stranger", {"s": src}, [WriteOp("s", "x", 0, 0, 16)], tag="t")
    assert done.wait(5) and not done.applied
    b.accept("r")
    b.revoke("r")
    done = a.post_writes("r", {"s": src}, [WriteOp("s", "x", 0, 0, 16)], tag="t")
    assert done.wait(5) and not done.applied
    assert int(region.sum()) == 0


def test_pacer_books_the_link_like_a_virtual_clock():
    pacer = Pacer(gbps=8.0)  # 1 GB/s
    assert pacer.transfer_seconds(10**9) == pytest.approx(1.0)
    first = pacer.reserve(10**6)
    second = pacer.reserve(10**6)
    assert second - first == pytest.approx(1e-3)
    assert Pacer(None).transfer_seconds(10**9) == 0.0
    with pytest.raises(ValueError):
        Pacer(0)


def _write_ones(prefill, decode, num_bytes: int, tag: str) -> torch.Tensor:
    """One push of `num_bytes` ones under `tag` into a fresh region of request "r" on the decode end, waited for;
    returns the region."""
    region = torch.zeros(num_bytes, dtype=torch.uint8)
    decode.push.register_region("x", region)
    decode.push.accept("r")
    ones = torch.ones(num_bytes, dtype=torch.uint8)
    prefill.push.post_writes("r", {"s": ones}, [WriteOp("s", "x", 0, 0, num_bytes)], tag=tag).wait(10)
    return region


def test_paced_lane_takes_at_least_the_wire_time(lane_kind):
    prefill, decode = make_link(lane_kind, gbps=0.08)  # 10 MB/s
    try:
        started = time.monotonic()
        region = _write_ones(prefill, decode, 200_000, "t")
        # functional lower bound (20 ms of wire time), never an upper bound: the machine is shared
        assert time.monotonic() - started >= 0.019
        assert int(region.sum()) == 200_000
        # the link was busy for the wire time; posting the one descriptor took a sliver of it, counted apart
        deadline = time.monotonic() + 5  # the sending thread counts its time just after the batch completes
        while not (counts := prefill.push.counters.snapshot())["posting_seconds"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counts["busy_seconds"] >= 0.019
        assert counts["posting_seconds"] > 0
        if lane_kind in ("inproc", "tcp"):  # a one-sided transport's write may take longer than the pacer's wait
            assert counts["posting_seconds"] < counts["busy_seconds"]
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("direction", ["prefill->decode", "decode->prefill"])
def test_message_payloads_pay_the_pacer_too(lane_kind, direction):
    """A fetch reply's KV crosses the same link as a push: it must take its wire time, either way."""
    prefill, decode = make_link(lane_kind, gbps=0.08)  # 10 MB/s
    sender, receiver = (prefill, decode) if direction == "prefill->decode" else (decode, prefill)
    try:
        started = time.monotonic()
        sender.control.send(Message(MessageKind.FETCH_REPLY, "r", {}, {"k": torch.ones(50_000)}))  # 200 kB
        reply = receiver.control.recv(timeout=10)
        assert reply is not None and reply.payload["k"].sum() == 50_000
        assert time.monotonic() - started >= 0.019
    finally:
        prefill.close()
        decode.close()


def test_close_wakes_receivers_and_drops_pending_work(lane_kind):
    prefill, decode = make_link(lane_kind, gbps=0.001)
    a, b = prefill.push, decode.push
    b.register_region("x", torch.zeros(10**6, dtype=torch.uint8))
    b.accept("r")
    got = []
    waiter = threading.Thread(target=lambda: got.append(b.recv(timeout=30)))
    waiter.start()
    pending = [
        a.post_writes("r", {"s": torch.ones(10**5, dtype=torch.uint8)}, [WriteOp("s", "x", 0, 0, 10**5)], tag="t")
        for _ in range(3)
    ]
    a.close()
    waiter.join(10)
    assert not waiter.is_alive() and got == [None]
    assert all(p.wait(10) for p in pending)
    prefill.close()
    decode.close()


def test_every_lane_books_what_it_sends_under_its_tag(lane_kind):
    """A push under its tag, a message under the one it was sent with, a low-priority one marked `/low`."""
    prefill, decode = make_link(lane_kind, gbps=0.8)  # 100 MB/s
    try:
        _write_ones(prefill, decode, 40_000, "proactive")
        prefill.control.send(Message(MessageKind.FETCH_REPLY, "r", {}, {"k": torch.ones(5_000)}), tag="on_demand")
        low = Message(MessageKind.FETCH_REPLY, "r", {}, {"k": torch.ones(2_500)}, priority=1)
        prefill.control.send(low, tag="on_demand")
        assert decode.control.recv(timeout=10) is not None and decode.control.recv(timeout=10) is not None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            booked: dict[str, int] = {}
            for _, counts in prefill.pacer.timeline.snapshot()["bins"]:
                for tag, num_bytes in counts.items():
                    booked[tag] = booked.get(tag, 0) + num_bytes
            if {"proactive", "on_demand", "on_demand/low"} <= set(booked):
                break
            time.sleep(0.01)
        assert booked["proactive"] >= 40_000  # the payload, and on some lanes its frame's header
        assert 20_000 <= booked["on_demand"] < 40_000 and 10_000 <= booked["on_demand/low"] < 20_000
    finally:
        prefill.close()
        decode.close()


def test_writes_of_several_tags_queued_back_to_back_each_book_under_their_own(lane_kind):
    """The TCP lane sends queued WRITEs in one call; a run keeps to one tag, so each path's bytes are its own."""
    prefill, decode = make_link(lane_kind, gbps=0.08)  # 10 MB/s: the first write holds the sender for 10 ms
    try:
        region = torch.zeros(200_000, dtype=torch.uint8)
        decode.push.register_region("x", region)
        decode.push.accept("r")
        ones = torch.ones(100_000, dtype=torch.uint8)
        tags = ["proactive"] + ["speculative", "proactive"] * 3  # the six behind the first queue while it crosses
        sizes = [100_000] + [10_000] * 6
        pending, offset = [], 0
        for tag, size in zip(tags, sizes, strict=True):
            op = WriteOp("s", "x", 0, offset, size)
            pending.append(prefill.push.post_writes("r", {"s": ones}, [op], tag=tag))
            offset += size
        assert all(p.wait(10) for p in pending)
        booked: dict[str, int] = {}
        for _, counts in prefill.pacer.timeline.snapshot()["bins"]:
            for tag, num_bytes in counts.items():
                booked[tag] = booked.get(tag, 0) + num_bytes
        # the payloads, and on some lanes their frames' headers (a few hundred bytes each)
        assert 130_000 <= booked["proactive"] < 135_000, booked
        assert 30_000 <= booked["speculative"] < 35_000, booked
        assert int(region.sum()) == 160_000
    finally:
        prefill.close()
        decode.close()
