"""Property tests (hypothesis) of the TCP frame decoder and the handshake against arbitrary peer bytes.

Properties: whatever a peer sends, the receive loop ends (or goes on) without an exception
escaping it, no byte lands outside the accepted request's slot, and a handshake never
succeeds without the secret. A small run is in the default suite; the slow test runs
10,000+ cases of each.
"""

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smartgen.lanes.auth import client_handshake, server_handshake
from smartgen.lanes.tcp import TcpLane
from smartgen.lanes.wire import HEADER, MAGIC, PROTOCOL_VERSION, FrameType, HandshakeError

REGION = 512
SLOT = (128, 256)  # request "r" may write k[128:256]
SENTINEL = 7
IDENTITY = {"fingerprint": "f", "model": "m", "layout": [2, 2, 4, "float32", 8]}


class ScriptedSocket:
    """A socket whose peer's bytes are fixed in advance; what we send is recorded (and dropped)."""

    def __init__(self, incoming: bytes) -> None:
        self.incoming = memoryview(incoming)
        self.sent = bytearray()

    def recv_into(self, view, nbytes: int = 0) -> int:
        size = min(len(view), len(self.incoming))
        view[:size] = self.incoming[:size]
        self.incoming = self.incoming[size:]
        return size  # 0 at the end: the peer closed

    def sendall(self, data) -> None:
        self.sent += bytes(data)

    def setsockopt(self, *args) -> None:
        pass

    def gettimeout(self) -> None:
        return None

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        pass


def _frame(frame_type: int, request_id: bytes, meta: bytes, payload: bytes, declared: int | None = None) -> bytes:
    length = len(payload) if declared is None else declared
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, frame_type, len(request_id), len(meta), length)
    return header + request_id + meta + payload


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
offsets = st.integers(-8, REGION + 8) | st.sampled_from([SLOT[0], SLOT[1] - 8, SLOT[1], 2**63]) | json_values
descriptor = st.tuples(st.sampled_from(["k", "v", "mask", ""]), offsets, st.integers(-4, 64) | json_values)


@st.composite
def write_frames(draw) -> bytes:
    ops = draw(st.lists(descriptor.map(list), max_size=4))
    meta: dict = {"seq": draw(st.integers(0, 5) | json_values), "ops": ops}
    if draw(st.booleans()):
        meta = draw(st.dictionaries(st.sampled_from(["seq", "ops", "t", "x"]), json_values, max_size=3)) | meta
    body = json.dumps(meta).encode()
    lengths = [op[2] for op in ops if type(op[2]) is int and op[2] > 0]
    payload = b"\xff" * min(sum(lengths), 4096)
    declared = draw(st.none() | st.integers(0, 5000))
    request_id = draw(st.sampled_from([b"r", b"other", b"", b"\xff\xfe"]))
    return _frame(int(FrameType.WRITE), request_id, body, payload[: declared or None], declared)


@st.composite
def message_frames(draw) -> bytes:
    spec = draw(
        st.lists(
            st.tuples(st.text(max_size=3), st.sampled_from(["float32", "int64", "uint8", "nope"]), json_values).map(
                list
            ),
            max_size=3,
        )
    )
    meta = {"kind": draw(st.integers(-1, 12) | json_values), "meta": draw(json_values), "payload": spec}
    declared = draw(st.integers(0, 256))
    return _frame(int(FrameType.MESSAGE), b"r", json.dumps(meta).encode(), b"\x01" * declared)


@st.composite
def other_frames(draw) -> bytes:
    frame_type = draw(st.integers(0, 255))
    meta = json.dumps(draw(json_values)).encode()
    return _frame(frame_type, b"", meta, b"", draw(st.integers(0, 2**64 - 1)))


raw_header = st.builds(
    lambda *f: struct.pack("<2sBBHIQ", *f),
    st.sampled_from([MAGIC, b"XX"]),
    st.sampled_from([PROTOCOL_VERSION, 1, 255]),
    st.integers(0, 255),
    st.integers(0, 2**16 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
)
streams = st.lists(
    write_frames() | message_frames() | other_frames() | raw_header | st.binary(max_size=64), min_size=1, max_size=5
).map(b"".join)


def _run_stream(data: bytes) -> None:
    lane = TcpLane(ScriptedSocket(data), "fuzz", threads=False)
    k = torch.full((REGION,), SENTINEL, dtype=torch.uint8)
    lane.register_region("k", k)
    lane.register_region("mask", torch.full((64,), SENTINEL, dtype=torch.uint8))
    lane.accept("r", {"k": [SLOT]})
    lane._receive_loop()  # returns once the scripted peer's bytes run out or a frame is refused; never raises
    assert lane.closed and lane.error
    outside = torch.cat([k[: SLOT[0]], k[SLOT[1] :]])
    assert bool((outside == SENTINEL).all()), "a write landed outside its request's slot"
    assert bool((lane._regions["mask"] == SENTINEL).all()), "a write landed in a region outside the request's extents"


def _server_side(data: bytes) -> None:
    sock = ScriptedSocket(data)
    try:
        server_handshake(sock, "secret", IDENTITY)
    except (HandshakeError, ConnectionError):
        return
    raise AssertionError("a HELLO without the secret was welcomed")


def _client_side(data: bytes) -> None:
    sock = ScriptedSocket(data)
    try:
        client_handshake(sock, "secret", {**IDENTITY, "channel": "push", "session": "s"})
    except (HandshakeError, ConnectionError):
        return
    raise AssertionError("a server without the secret was accepted")


@st.composite
def hellos(draw) -> bytes:
    meta = draw(st.dictionaries(st.sampled_from(["mac", "nonce", "fingerprint", "layout", "x"]), json_values))
    if draw(st.booleans()):
        meta = {**IDENTITY, "nonce": draw(st.text("0123456789abcdef", min_size=32, max_size=32)), **meta}
    body = json.dumps(meta).encode()
    return _frame(int(FrameType.HELLO), b"", body, b"") if draw(st.booleans()) else draw(raw_header) + body


@st.composite
def server_replies(draw) -> bytes:
    nonce = draw(st.text("0123456789abcdef", min_size=32, max_size=32) | json_values)
    challenge = _frame(int(FrameType.CHALLENGE), b"", json.dumps({"nonce": nonce}).encode(), b"")
    kind = draw(st.sampled_from([FrameType.WELCOME, FrameType.REJECT, FrameType.CHALLENGE]))
    reply_meta = {"mac": draw(st.text("0123456789abcdef", max_size=64) | json_values)}
    return challenge + _frame(int(kind), b"", json.dumps(reply_meta).encode(), b"") + draw(st.binary(max_size=16))


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))


@FAST
@given(streams)
def test_frame_decoder_survives_any_stream(data):
    _run_stream(data)


@FAST
@given(hellos() | st.binary(max_size=200))
def test_server_handshake_refuses_any_hello_without_the_secret(data):
    _server_side(data)


@FAST
@given(server_replies() | st.binary(max_size=200))
def test_client_handshake_refuses_any_server_without_the_secret(data):
    _client_side(data)


@pytest.mark.slow
@SLOW
@given(streams)
def test_frame_decoder_survives_any_stream_10k(data):
    _run_stream(data)


@pytest.mark.slow
@SLOW
@given(hellos() | st.binary(max_size=200))
def test_server_handshake_refuses_any_hello_without_the_secret_10k(data):
    _server_side(data)


@pytest.mark.slow
@SLOW
@given(server_replies() | st.binary(max_size=200))
def test_client_handshake_refuses_any_server_without_the_secret_10k(data):
    _client_side(data)
