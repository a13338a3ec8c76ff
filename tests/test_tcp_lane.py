"""Socket lanes (TCP, Mooncake, NIXL, RDMA) over 127.0.0.1: in-place writes, ordering, refusals, peer death, the engine on top."""

import time

import pytest
import torch

from smartgen.lanes import Message, MessageKind, WriteOp
from smartgen.lanes.backends import lane_factory, loopback_link
from smartgen.lanes.tcp_link import TcpListener, loopback_tcp_link, parse_address, tcp_connect
from smartgen.lanes.wire import HandshakeError

IDENTITY = {"fingerprint": "f00d", "model": "tiny", "layout": [4, 2, 8, "float32", 16]}


@pytest.fixture
def link(socket_lane_kind):
    prefill, decode = loopback_link(socket_lane_kind)
    yield prefill, decode
    prefill.close()
    decode.close()


def test_writes_land_in_place_in_order_and_messages_follow(link):
    prefill, decode = link
    region = torch.zeros(256, dtype=torch.uint8)
    decode.push.register_region("kv", region)
    decode.push.accept("r")
    src = torch.arange(256, dtype=torch.uint8)
    done = [
        prefill.push.post_writes("r", {"s": src}, [WriteOp("s", "kv", i, i, 16)], tag="t") for i in range(0, 256, 16)
    ]
    assert all(d.wait(5) and d.applied for d in done)
    assert torch.equal(region, src)
    prefill.control.send(
        Message(
            MessageKind.FETCH_REPLY,
            "r",
            {"fetch_id": 3},
            {"k": torch.ones(2, 3), "v": torch.zeros(2, 3, dtype=torch.bfloat16)},
        )
    )
    reply = decode.control.recv(timeout=5)
    assert reply.kind == MessageKind.FETCH_REPLY and reply.meta == {"fetch_id": 3}
    assert torch.equal(reply.payload["k"], torch.ones(2, 3)) and reply.payload["v"].dtype == torch.bfloat16


def test_revoked_writes_are_read_off_the_wire_and_dropped(link):
    prefill, decode = link
    region = torch.zeros(32, dtype=torch.uint8)
    decode.push.register_region("kv", region)
    done = prefill.push.post_writes(
        "gone", {"s": torch.ones(32, dtype=torch.uint8)}, [WriteOp("s", "kv", 0, 0, 32)], tag="t"
    )
    assert done.wait(5) and not done.applied
    assert int(region.sum()) == 0
    decode.push.accept("r")  # the stream is still in sync after a dropped write
    done = prefill.push.post_writes(
        "r", {"s": torch.ones(32, dtype=torch.uint8)}, [WriteOp("s", "kv", 0, 0, 32)], tag="t"
    )
    assert done.wait(5) and done.applied and int(region.sum()) == 32


@pytest.mark.parametrize(
    "secret,identity,version,reason",
    [
        ("wrong", IDENTITY, None, "wrong shared secret"),
        ("s", {**IDENTITY, "fingerprint": "beef"}, None, "model mismatch"),
        ("s", {**IDENTITY, "layout": [4, 2, 16, "float32", 16]}, None, "KV layout mismatch"),
        ("s", IDENTITY, 9, "protocol version mismatch"),
    ],
)
def test_handshake_refusals_say_which_check_failed(socket_lane_kind, secret, identity, version, reason):
    factory = lane_factory(socket_lane_kind)
    listener = TcpListener("127.0.0.1", 0, "s", IDENTITY, lane_factory=factory)
    try:
        kwargs = {} if version is None else {"version": version}
        with pytest.raises(HandshakeError, match=reason):
            tcp_connect(*listener.address, secret, identity, lane_factory=factory, **kwargs)
        assert listener.accept(timeout=0.2) is None
    finally:
        listener.close()


def test_a_dead_peer_wakes_receivers_and_fails_pending_writes(link):
    prefill, decode = link
    decode.push.register_region("kv", torch.zeros(10**6, dtype=torch.uint8))
    decode.push.accept("r")
    decode.close()
    assert prefill.control.recv(timeout=10) is None  # woken, not hung
    deadline = time.monotonic() + 5
    while not prefill.push.closed and time.monotonic() < deadline:
        prefill.push.post_writes(
            "r", {"s": torch.ones(10**6, dtype=torch.uint8)}, [WriteOp("s", "kv", 0, 0, 10**6)], tag="t"
        )
        time.sleep(0.01)
    assert prefill.push.closed and prefill.push.error


def test_paced_tcp_link_takes_at_least_the_wire_time():
    prefill, decode = loopback_tcp_link(gbps=0.08)  # 10 MB/s
    try:
        decode.push.register_region("kv", torch.zeros(300_000, dtype=torch.uint8))
        decode.push.accept("r")
        started = time.monotonic()
        prefill.push.post_writes(
            "r", {"s": torch.ones(300_000, dtype=torch.uint8)}, [WriteOp("s", "kv", 0, 0, 300_000)], tag="t"
        ).wait(30)
        assert time.monotonic() - started >= 0.028  # 30 ms of wire time, a lower bound only
    finally:
        prefill.close()
        decode.close()


def test_parse_address():
    assert parse_address("10.0.0.1:8000") == ("10.0.0.1", 8000)
    assert parse_address(":9") == ("127.0.0.1", 9)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("nope")
