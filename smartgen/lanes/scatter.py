"""Many small write descriptors as a few strided copies: a WRITE's rows gathered or landed without a Python step each.

A speculative push of hinted entries is thousands of rows of a few hundred bytes (one KV head of
one token, and its mask byte). Walked one row at a time, the decode node's receive thread spent
about 3 us of its one CPU per row beside the decode step. Here a frame's payload is read into one
staging buffer and its rows land by fancy-index copies over strided row views (numpy), one per
distinct row length a region has in a phase (`phases`); the sender gathers them the same way. Large
rows are left to the per-row path, which reads them straight from the socket into place.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

__all__ = ["worth_gathering", "phases", "overlapping", "copy_rows", "MAX_LENGTHS"]

MIN_ROWS = 384  # below this the per-row path costs as little (measured: `bench/tcp_batch_cpu.py --rows`)
MAX_MEAN_ROW = 4096  # rows larger on average gain nothing from staging: each is one memcpy either way
MAX_PAYLOAD = 16 << 20  # staging memory is bounded: a larger frame of small rows goes row by row
MAX_LENGTHS = 64  # one copy per distinct row length: more than this, and row by row is as cheap


def worth_gathering(num_rows: int, payload_bytes: int) -> bool:
    """True when a WRITE of `num_rows` rows and `payload_bytes` bytes is cheaper staged than row by row."""
    return num_rows >= MIN_ROWS and payload_bytes <= MAX_PAYLOAD and payload_bytes <= MAX_MEAN_ROW * num_rows


def phases(codes: np.ndarray) -> list[tuple[int, int]]:
    """[(first, stop), ...]: the shortest spans of rows, in order, such that no region (code) has rows in two.

    Landed phase after phase, a frame keeps the order that matters across regions (a push's K and V rows,
    interleaved, all land before its mask rows, which follow them); inside a phase the rows of different
    regions land region by region, so their relative order there is not kept."""
    n = len(codes)
    if not n:
        return []
    last = np.zeros(int(codes.max()) + 1, dtype=np.int64)
    np.maximum.at(last, codes, np.arange(n))
    reach = np.maximum.accumulate(last[codes])  # the last row of any region seen so far
    ends = (np.flatnonzero(reach == np.arange(n)) + 1).tolist()
    return list(zip([0, *ends[:-1]], ends))


def overlapping(offsets: np.ndarray, lengths: np.ndarray) -> bool:
    """True when two rows [offset, offset + length) share a byte (then one copy would not say which lands last)."""
    if len(offsets) < 2:
        return False
    order = np.argsort(offsets, kind="stable")
    first, size = offsets[order], lengths[order]
    return bool(((first[:-1] + size[:-1]) > first[1:]).any())


def copy_rows(
    dst: np.ndarray,
    dst_offsets: np.ndarray,
    src: np.ndarray,
    src_offsets: np.ndarray,
    lengths: np.ndarray,
    *,
    may_overlap: bool = False,
) -> None:
    """dst[d : d + n] = src[s : s + n] for every row (flat uint8 arrays). Rows that share bytes of `dst` (only where
    `may_overlap` says they can) are copied one by one in order, so the later one lands last."""
    distinct = np.unique(lengths)
    if len(distinct) > MAX_LENGTHS or (may_overlap and overlapping(dst_offsets, lengths)):
        for d, s, n in zip(dst_offsets.tolist(), src_offsets.tolist(), lengths.tolist()):
            dst[d : d + n] = src[s : s + n]
        return
    for length in distinct.tolist():
        mine = lengths == length
        _rows(dst, length, writeable=True)[dst_offsets[mine]] = _rows(src, length)[src_offsets[mine]]


def _rows(flat: np.ndarray, length: int, writeable: bool = False) -> np.ndarray:
    """Every `length`-byte window of `flat`, as rows: row i is flat[i : i + length] (a view, no copy)."""
    return as_strided(flat, shape=(len(flat) - length + 1, length), strides=(1, 1), writeable=writeable)
