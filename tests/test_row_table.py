"""WRITEs of many small rows: sent as a row table, gathered and landed by strided copies, byte for byte what the
row-by-row path lands (and drops), in order where order matters; a malformed table closes the connection."""

import base64
import itertools
import socket
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smartgen.lanes import WriteOp
from smartgen.lanes.row_table import RowTable, check_write_table, encode_table
from smartgen.lanes.scatter import copy_rows, overlapping, phases, worth_gathering
from smartgen.lanes.tcp import TcpLane, _Batch
from smartgen.lanes.tcp_link import loopback_tcp_link
from smartgen.lanes.wire import FrameType, recv_header, send_header

REGION = 4096
SLOTS = {"k": [(0, 3000)], "v": [(512, 4096)], "mask": [(0, 64), (128, 4096)]}


def test_phases_keep_kv_rows_together_and_mask_rows_after_them():
    k, v, mask = 0, 1, 2
    assert phases(np.array([k, v, k, v, mask, mask])) == [(0, 4), (4, 6)]
    assert phases(np.array([k, mask, k, mask])) == [(0, 4)]  # interleaved: one phase, nothing can go first
    assert phases(np.array([k, k, v, mask, v])) == [(0, 2), (2, 5)]
    assert phases(np.array([], dtype=np.int64)) == []


def test_overlapping_rows_are_told_apart_from_adjacent_ones():
    assert not overlapping(np.array([0, 8, 4]), np.array([4, 4, 4]))  # adjacent, out of order
    assert overlapping(np.array([0, 8, 3]), np.array([4, 4, 4]))
    assert not overlapping(np.array([5]), np.array([100]))


def test_copy_rows_matches_a_copy_per_row_for_many_lengths():
    rng = np.random.default_rng(3)
    for num_lengths in (1, 5, 200):  # 200 distinct lengths: past MAX_LENGTHS, row by row
        lengths = rng.integers(1, num_lengths + 1, size=300)
        dst_offsets = np.cumsum(lengths + rng.integers(0, 3, size=300)) - lengths  # disjoint, with gaps
        src = rng.integers(0, 256, size=int(lengths.sum()) + 50, dtype=np.uint8)
        src_offsets = rng.integers(0, 50, size=300)
        dst = np.zeros(int(dst_offsets[-1] + lengths[-1]) + 7, dtype=np.uint8)
        expected = dst.copy()
        for d, s, n in zip(dst_offsets, src_offsets, lengths):
            expected[d : d + n] = src[s : s + n]
        copy_rows(dst, dst_offsets, src, src_offsets, lengths)
        assert np.array_equal(dst, expected), num_lengths


def test_a_table_round_trips_and_its_rows_read_as_ops():
    ops = [("k", 0, 8), ("v", 16, 4), ("k", 8, 2)]
    table = RowTable.from_ops(ops)
    assert table.names == ["k", "v"] and table.as_ops() == ops
    decoded = check_write_table(encode_table(table.names, table.codes, table.offsets, table.lengths), 14, 10)
    assert decoded.as_ops() == ops


@pytest.mark.parametrize(
    "table,payload,reason",
    [
        ("rows", 8, "not an object"),
        ({"regions": ["k"], "rows": 5}, 8, "base64 string"),
        ({"regions": [], "rows": ""}, 0, "1 to 64 names"),
        ({"regions": ["k", 3], "rows": ""}, 0, "1 to 64 names"),
        ({"regions": ["k"], "rows": "!!!"}, 8, "not base64"),
        ({"regions": ["k"], "rows": base64.b64encode(b"\0" * 20).decode()}, 8, "whole [n, 3] int64 rows"),
        ({"regions": ["k"], "rows": "", "extra": 1}, 0, "not an object"),
        (encode_table(["k"], np.array([1]), np.array([0]), np.array([8])), 8, "does not list"),
        (encode_table(["k"], np.array([0]), np.array([-4]), np.array([8])), 8, "negative offset"),
        (encode_table(["k"], np.array([0, 0]), np.array([0, 8]), np.array([8, 0])), 8, "not positive"),
        (encode_table(["k"], np.array([0]), np.array([0]), np.array([8])), 12, "add up to the payload's 12"),
        (encode_table(["k"], np.array([0, 0]), np.array([0, 0]), np.array([2**62, -(2**62) + 8])), 8, "not positive"),
        (encode_table(["k"], np.zeros(11, dtype=np.int64), np.arange(11), np.ones(11, dtype=np.int64)), 11, "at most"),
    ],
)
def test_a_malformed_table_is_refused_with_the_reason(table, payload, reason):
    with pytest.raises(ConnectionError, match=reason.replace("[", r"\[")):
        check_write_table(table, payload, max_rows=10)


def _reference(ops: list[tuple[str, int, int]], payload: bytes) -> tuple[dict[str, bytearray], bool]:
    """What the row-by-row rule lands: each row in order, where it lies inside its region's slot; else dropped."""
    regions = {name: bytearray(REGION) for name in SLOTS}
    applied, at = True, 0
    for name, offset, length in ops:
        inside = any(a <= offset and offset + length <= b for a, b in SLOTS.get(name, []))
        if inside and offset + length <= REGION:
            regions[name][offset : offset + length] = payload[at : at + length]
        else:
            applied = False
        at += length
    return regions, applied


@pytest.fixture(scope="module")
def receiver():
    """A receiving TcpLane with regions k, v, mask (request "r" accepted in SLOTS) and its peer's raw socket."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname()[:2])
        mine, _ = server.accept()
    endpoint = TcpLane(mine, "receiver")
    for name in SLOTS:
        endpoint.register_region(name, torch.zeros(REGION, dtype=torch.uint8))
    endpoint.accept("r", SLOTS)
    theirs.settimeout(10)
    yield endpoint, theirs
    endpoint.close()
    theirs.close()


_seqs = itertools.count(1)  # the raw peer numbers its WRITEs itself
_rows = st.lists(
    st.tuples(st.sampled_from(["k", "v", "mask", "mask", "zz"]), st.integers(0, REGION + 64), st.integers(1, 96)),
    min_size=384,
    max_size=500,
)


@settings(max_examples=60, deadline=None)
@given(_rows, st.booleans(), st.integers(0, 2**31))
def test_a_frame_of_small_rows_lands_what_the_row_path_lands(receiver, rows, as_table, seed):
    """Rows inside and outside their slots, overlapping ones and interleaved regions, sent as a JSON list (landed
    by the gathered path) or as a table: every region ends byte for byte as landing the rows one by one leaves it,
    and the ACK says whether the WRITE was applied whole."""
    endpoint, peer = receiver
    for name in SLOTS:
        endpoint._regions[name].zero_()
    payload = np.random.default_rng(seed).integers(1, 256, size=sum(n for _, _, n in rows), dtype=np.uint8).tobytes()
    assert worth_gathering(len(rows), len(payload))
    seq = next(_seqs)
    if as_table:
        table = RowTable.from_ops(rows)
        meta = {"seq": seq, "table": encode_table(table.names, table.codes, table.offsets, table.lengths)}
    else:
        meta = {"seq": seq, "ops": [list(row) for row in rows]}
    send_header(peer, FrameType.WRITE, "r", meta, len(payload))
    peer.sendall(payload)
    ack = recv_header(peer)
    expected, applied = _reference(rows, payload)
    assert ack.type == FrameType.ACK and ack.meta == {"seq": seq, "dropped": [] if applied else [seq]}
    for name, region in endpoint._regions.items():
        assert bytes(region.numpy()) == bytes(expected[name]), name


@pytest.mark.parametrize(
    "table,reason",
    [
        ({"regions": ["k"], "rows": "%%"}, "not base64"),
        (encode_table(["k"], np.array([2]), np.array([0]), np.array([8])), "does not list"),
        (encode_table(["k"], np.array([0]), np.array([0]), np.array([4])), "add up to the payload"),
    ],
)
def test_a_malformed_table_closes_the_connection_and_lands_nothing(table, reason):
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname()[:2])
        mine, _ = server.accept()
    endpoint = TcpLane(mine, "victim")
    try:
        endpoint.register_region("k", torch.zeros(REGION, dtype=torch.uint8))
        endpoint.accept("r")
        send_header(theirs, FrameType.WRITE, "r", {"seq": 1, "table": table}, 8)
        theirs.sendall(b"\xff" * 8)
        deadline = time.monotonic() + 5
        while not endpoint.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert endpoint.closed and reason in (endpoint.error or ""), endpoint.error
        assert int(endpoint._regions["k"].sum()) == 0
    finally:
        endpoint.close()
        theirs.close()


def test_both_ops_and_a_table_in_one_write_is_refused():
    from smartgen.lanes.checks import check_write

    table = encode_table(["k"], np.array([0]), np.array([0]), np.array([8]))
    with pytest.raises(ConnectionError, match="both ops and a table"):
        check_write({"seq": 1, "ops": [["k", 0, 8]], "table": table}, 8)


def test_a_lane_pair_gathers_small_rows_into_one_table_frame_and_lands_them_in_place():
    """Through two real lanes: a push of hundreds of scattered K, V and mask rows (what a hinted speculative slice
    is) leaves the sender as one gathered buffer and lands in the receiver's regions, mask rows after the data."""
    prefill, decode = loopback_tcp_link()
    try:
        regions = {name: torch.zeros(1 << 16, dtype=torch.uint8) for name in ("k", "v", "mask")}
        for name, region in regions.items():
            decode.push.register_region(name, region)
        decode.push.accept("r")
        k = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
        v = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
        ones = torch.ones(64, dtype=torch.uint8)
        entries = list(range(0, 600, 3))  # 600 rows
        data = [WriteOp(name, name, 96 * e, 96 * e, 96) for e in entries for name in ("k", "v")]
        masks = [WriteOp("ones", "mask", 0, e, 1) for e in entries]
        sources = {"k": k, "v": v, "ones": ones}
        parts = TcpLane._write_frames([_Batch(1, "r", sources, data + masks, 193 * len(entries))], {})
        assert len(parts) == 2 and b'"table"' in bytes(parts[0]), "one header with a table, one gathered payload"
        done = prefill.push.post_writes("r", sources, data + masks, tag="speculative")
        assert done.wait(10) and done.applied
        for e in entries:
            rows = slice(96 * e, 96 * e + 96)
            assert torch.equal(regions["k"][rows], k[rows]) and torch.equal(regions["v"][rows], v[rows])
            assert int(regions["mask"][e]) == 1
        assert int(regions["mask"].sum()) == len(entries)
        assert int((regions["k"] != 0).sum()) <= 96 * len(entries)  # nothing between the rows
    finally:
        prefill.close()
        decode.close()


@given(
    st.lists(st.tuples(st.integers(0, 500), st.integers(1, 80)), max_size=6),
    st.lists(st.tuples(st.integers(-3, 700), st.integers(-2, 90)), min_size=1, max_size=60),
)
def test_slot_extents_allow_many_rows_exactly_as_one_by_one(ranges, rows):
    from smartgen.lanes.extents import SlotExtents

    extents = SlotExtents({"k": [(a, a + n) for a, n in ranges]})
    offsets = np.array([o for o, _ in rows], dtype=np.int64)
    lengths = np.array([n for _, n in rows], dtype=np.int64)
    many = extents.allows_many("k", offsets, lengths).tolist()
    assert many == [extents.allows("k", o, n) for o, n in rows]
    assert not extents.allows_many("v", offsets, lengths).any()
