"""The TCP lane's small-batch path: buffered frame reading, coalesced ACKs, gathered WRITEs, kernel-side leases.

Coalesced ACKs must still complete every batch exactly once and in posting order, with the right
`applied`; a reader that buffers must hand out the same frames and bytes as exact reads, wherever
the stream is cut; gathering WRITEs into one send must not let any byte skip the pacer.
"""

import socket
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smartgen.lanes import WriteOp
from smartgen.lanes.liveness import Lease, arm, arm_in_kernel
from smartgen.lanes.reader import BUFFER_BYTES, FrameReader
from smartgen.lanes.tcp import TcpLane
from smartgen.lanes.tcp_link import loopback_tcp_link
from smartgen.lanes.wire import FrameType, header_bytes, recv_header, send_header


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
    return accepted, client


def _write_frame(request_id: str, seq: int, offset: int, payload: bytes) -> bytes:
    meta = {"seq": seq, "ops": [["k", offset, len(payload)]]}
    return header_bytes(FrameType.WRITE, request_id, meta, len(payload)) + payload


def _acks(sock: socket.socket, last: int) -> list[dict]:
    """ACK metas read until one acknowledges `last` (heartbeats skipped)."""
    acks: list[dict] = []
    while not acks or acks[-1]["seq"] < last:
        frame = recv_header(sock)
        if frame.type == FrameType.ACK:
            acks.append(frame.meta)
    return acks


def test_writes_that_arrive_together_share_one_ack_and_it_names_the_dropped_ones():
    mine, peer = _tcp_pair()
    lane = TcpLane(mine, "receiver")
    region = torch.zeros(64, dtype=torch.uint8)
    lane.register_region("k", region)
    lane.accept("r")
    peer.settimeout(5)
    try:
        frames = [
            _write_frame("r" if seq % 2 else "gone", seq, 8 * seq, bytes([seq]) * 8) for seq in range(1, 7)
        ]  # seqs 2, 4, 6 are for a request never accepted: read off the wire and dropped
        peer.sendall(b"".join(frames))  # one send: the receiver finds them all buffered
        acks = _acks(peer, 6)
        assert acks[-1]["seq"] == 6
        assert sorted(s for ack in acks for s in ack["dropped"]) == [2, 4, 6]
        assert len(acks) < 6, "frames that arrived together should share ACKs"
        for seq in range(1, 7):
            expected = seq if seq % 2 else 0
            assert region[8 * seq : 8 * seq + 8].tolist() == [expected] * 8
    finally:
        lane.close()
        peer.close()


def _writer(peer_reads: int):
    """A writing TcpLane whose peer is a raw socket; posts `peer_reads` one-byte batches and reads their frames."""
    mine, peer = _tcp_pair()
    lane = TcpLane(mine, "writer")
    peer.settimeout(5)
    order: list[tuple[int, bool]] = []
    done = []
    for i in range(peer_reads):
        completion = lane.post_writes(
            "r", {"s": torch.ones(8, dtype=torch.uint8)}, [WriteOp("s", "k", i, i, 1)], tag="t"
        )
        completion.add_done_callback(lambda applied, i=i: order.append((i + 1, applied)))
        done.append(completion)
    seqs = []
    while len(seqs) < peer_reads:
        frame = recv_header(peer)
        assert frame.type == FrameType.WRITE
        assert peer.recv(frame.payload_length, socket.MSG_WAITALL)
        seqs.append(frame.meta["seq"])
    assert seqs == list(range(1, peer_reads + 1))
    return lane, peer, order, done


def test_one_ack_completes_every_batch_up_to_it_once_and_in_order():
    lane, peer, order, done = _writer(5)
    try:
        send_header(peer, FrameType.ACK, "", {"seq": 3, "dropped": [2]}, 0)
        assert done[2].wait(5)
        assert order == [(1, True), (2, False), (3, True)] and not done[3].done()
        send_header(peer, FrameType.ACK, "", {"seq": 3, "dropped": []}, 0)  # a repeat completes nothing twice
        send_header(peer, FrameType.ACK, "", {"seq": 5, "dropped": [5]}, 0)
        assert done[4].wait(5)
        assert order == [(1, True), (2, False), (3, True), (4, True), (5, False)]
        assert [d.applied for d in done] == [True, False, True, True, False]
        assert lane.flush(5) and not lane.closed
    finally:
        lane.close()
        peer.close()


@pytest.mark.parametrize(
    "meta,reason",
    [
        ({"seq": 9, "dropped": []}, "ACK for WRITE 9, only 2 sent"),
        ({"seq": 1, "dropped": "all"}, "dropped is not a list"),
        ({"seq": 1, "dropped": [1.5]}, "ACK dropped seq is not an integer"),
        ({"seq": True}, "ACK seq is not an integer"),
    ],
)
def test_a_malformed_ack_closes_the_lane_with_the_reason_and_fails_what_is_pending(meta, reason):
    lane, peer, order, done = _writer(2)
    try:
        send_header(peer, FrameType.ACK, "", meta, 0)
        deadline = time.monotonic() + 5
        while not lane.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lane.closed and reason in (lane.error or ""), lane.error
        assert all(d.wait(5) for d in done) and sorted(order) == [(1, False), (2, False)]
    finally:
        lane.close()
        peer.close()


class ChoppedSocket:
    """Delivers a fixed byte stream in the given cut sizes (one piece per recv call), counting the calls."""

    def __init__(self, data: bytes, cuts: list[int], events: list[str] | None = None) -> None:
        self.data, self.cuts, self.calls = memoryview(data), cuts, 0
        self.events = events if events is not None else []

    def recv_into(self, view, nbytes: int = 0) -> int:
        self.calls += 1
        self.events.append("recv")
        size = min(len(view), len(self.data), self.cuts[self.calls % len(self.cuts)] if self.cuts else len(view))
        view[:size] = self.data[:size]
        self.data = self.data[size:]
        return size


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 70_000)), min_size=1, max_size=6),
    st.lists(st.integers(1, 100_000), max_size=5),
)
def test_the_buffered_reader_hands_out_what_exact_reads_would_wherever_the_stream_is_cut(frames, cuts):
    stream = b""
    expected = []
    for i, (meta_pad, payload_length) in enumerate(frames):
        meta = {"i": i, "pad": "x" * meta_pad}
        payload = bytes((i + j) % 251 for j in range(payload_length))
        stream += header_bytes(FrameType.MESSAGE, f"req{i}", meta, payload_length) + payload
        expected.append((meta, payload))
    events: list[str] = []
    sock = ChoppedSocket(stream, cuts, events)
    reader = FrameReader(sock, before_wait=lambda: events.append("wait"))  # type: ignore[arg-type]
    for i, (meta, payload) in enumerate(expected):
        frame = reader.read_frame()
        assert (frame.type, frame.request_id, frame.meta, frame.payload_length) == (
            FrameType.MESSAGE,
            f"req{i}",
            meta,
            len(payload),
        )
        got = bytearray(len(payload))
        cut = len(payload) // 3  # two destinations: rows of one WRITE
        reader.read_into_views([memoryview(got)[:cut], memoryview(got)[cut:]])
        assert bytes(got) == payload
        events.append("frame")
    assert reader.buffered == 0
    # what the lane relies on to send its ACK in time: after a frame is done, no socket read without `before_wait`
    after_frame = "".join({"frame": "f", "recv": "r", "wait": "w"}[e] for e in events)
    assert "fr" not in after_frame and after_frame.startswith("w"), after_frame


def test_one_receive_call_brings_a_small_frame_whole():
    frames = [_write_frame("r", seq, 0, b"\1" * 4096) for seq in range(1, 9)]
    sock = ChoppedSocket(b"".join(frames), [])
    reader = FrameReader(sock)  # type: ignore[arg-type]
    for _ in frames:
        frame = reader.read_frame()
        reader.skip(frame.payload_length)
    assert sock.calls <= -(-len(b"".join(frames)) // BUFFER_BYTES), "header, id and meta took separate calls"


def test_the_lease_moves_to_the_kernel_and_a_silent_peer_still_expires_it():
    a, b = _tcp_pair()
    try:
        arm(a, Lease(0.4))
        assert arm_in_kernel(a, Lease(0.4)) and a.gettimeout() is None
        started = time.monotonic()
        with pytest.raises(BlockingIOError):
            a.recv(1)  # the kernel's SO_RCVTIMEO: no poll() before each call, the same bound
        assert time.monotonic() - started >= 0.35
    finally:
        a.close()
        b.close()


def test_gathered_small_writes_pay_the_pacer_byte_for_byte():
    prefill, decode = loopback_tcp_link(gbps=0.08)  # 10 MB/s; 200 batches of 1 KiB = 20 ms of wire time
    try:
        region = torch.zeros(200 * 1024, dtype=torch.uint8)
        decode.push.register_region("kv", region)
        decode.push.accept("r")
        source = torch.ones(200 * 1024, dtype=torch.uint8)
        started = time.monotonic()
        done = [
            prefill.push.post_writes("r", {"s": source}, [WriteOp("s", "kv", i * 1024, i * 1024, 1024)], tag="t")
            for i in range(200)
        ]
        assert all(d.wait(30) and d.applied for d in done)
        assert time.monotonic() - started >= 0.019  # a lower bound only: the machine is shared
        assert int(region.sum()) == 200 * 1024
    finally:
        prefill.close()
        decode.close()
