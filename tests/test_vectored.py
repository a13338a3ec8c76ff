"""Scatter-gather socket I/O and the TCP lane's chunking: every byte arrives, in order, into the right buffer."""

import socket
import threading

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smartgen.lanes.framing import bytes_view
from smartgen.lanes.tcp import _chunks
from smartgen.lanes.vectored import MAX_BUFFERS, recv_into_views, send_views

sizes = st.lists(st.integers(0, 300_000), min_size=1, max_size=40)


def _views(tensor: torch.Tensor, lengths: list[int]) -> list[memoryview]:
    view, start, out = bytes_view(tensor), 0, []
    for length in lengths:
        out.append(view[start : start + length])
        start += length + 7  # gaps: the buffers are scattered, not one run
    return out


@settings(max_examples=25, deadline=None)
@given(sizes, st.integers(0, 2**31))
def test_scattered_buffers_arrive_whole_and_in_order(lengths, seed):
    total = sum(lengths) + 7 * len(lengths)
    source = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    sink = torch.zeros(total, dtype=torch.uint8)
    left, right = socket.socketpair()
    try:
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # small buffers: partial sends and receives
        right.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sender = threading.Thread(target=send_views, args=(left, _views(source, lengths)))
        sender.start()
        recv_into_views(right, _views(sink, lengths))
        sender.join(10)
        for src, dst in zip(_views(source, lengths), _views(sink, lengths)):
            assert bytes(src) == bytes(dst)
        gaps = torch.ones(total, dtype=torch.bool)
        for dst_start in range(len(lengths)):
            start = sum(lengths[:dst_start]) + 7 * dst_start
            gaps[start : start + lengths[dst_start]] = False
        assert int(sink[gaps].count_nonzero()) == 0, "a byte landed outside its buffer"
    finally:
        left.close()
        right.close()


def test_more_buffers_than_one_call_takes():
    count = 3 * MAX_BUFFERS + 5
    source = torch.arange(count * 3, dtype=torch.int64).to(torch.uint8)
    sink = torch.zeros_like(source)
    left, right = socket.socketpair()
    try:
        parts = [bytes_view(source)[i * 3 : i * 3 + 3] for i in range(count)]
        sender = threading.Thread(target=send_views, args=(left, [b"head", *parts]))
        sender.start()
        head = bytearray(4)
        recv_into_views(right, [memoryview(head), *[bytes_view(sink)[i * 3 : i * 3 + 3] for i in range(count)]])
        sender.join(10)
        assert head == b"head" and torch.equal(source, sink)
    finally:
        left.close()
        right.close()


@given(st.lists(st.integers(0, 5_000), max_size=30), st.integers(1, 7_000))
def test_chunks_cut_the_parts_in_order_and_bounded(lengths, size):
    data = bytes(range(256)) * (sum(lengths) // 256 + 1)
    view, start, parts = memoryview(data), 0, []
    for length in lengths:
        parts.append(view[start : start + length])
        start += length
    chunks = _chunks(parts, size)
    assert all(0 < sum(p.nbytes for p in chunk) <= size for chunk in chunks)
    assert b"".join(bytes(p) for chunk in chunks for p in chunk) == data[: sum(lengths)]
    assert all(sum(p.nbytes for p in chunk) == size for chunk in chunks[:-1]), "only the last chunk is short"
