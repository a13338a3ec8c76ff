"""Cuts a coalesced write batch for a one-sided transport: pacing chunks, and fenced runs per region."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from smartgen.lanes.base import WriteOp

__all__ = ["chunk_ops", "region_runs"]

T = TypeVar("T")


def chunk_ops(ops: Sequence[WriteOp], chunk_bytes: int) -> list[list[WriteOp]]:
    """Splits ops into consecutive chunks of at most `chunk_bytes` (a long op is cut), order kept.

    Each chunk is booked on the pacer as one piece, so a bulk push yields to an urgent
    transfer between chunks and a revoke waits for at most one chunk.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    chunks: list[list[WriteOp]] = [[]]
    room = chunk_bytes
    for op in ops:
        done = 0
        while done < op.length:
            if room == 0:
                chunks.append([])
                room = chunk_bytes
            take = min(room, op.length - done)
            chunks[-1].append(WriteOp(op.src, op.dst, op.src_offset + done, op.dst_offset + done, take))
            done += take
            room -= take
    return [chunk for chunk in chunks if chunk]


def region_runs(items: Sequence[T], ops: Sequence[WriteOp]) -> list[list[T]]:
    """Groups `items` (one per op) into maximal runs of ops with the same destination region.

    Transports that run a batch's writes in parallel (Mooncake, NIXL) write one run at a
    time, so every write to one region lands before any later write to another: a block's
    K and V before its mask.
    """
    runs: list[list[T]] = []
    last = None
    for item, op in zip(items, ops, strict=True):
        if not runs or op.dst != last:
            runs.append([])
            last = op.dst
        runs[-1].append(item)
    return runs
