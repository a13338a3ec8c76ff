"""Fetch replies that land in place: where each reply's bytes go, and the SEND sizes both ends agree on.

The decode node says, with a FETCH, where its reply belongs (a `Landing`: byte ranges of the pool's
K and V, one per run of consecutive entries). The lane turns them into scatter lists of at most
the device's max_sge elements, one RECV each, and sends their sizes with the FETCH
(`reply_chunks`). The prefill node's lane cuts its reply at exactly those sizes, after a header
message announcing it; only then does the decode lane post the RECVs, so a reply nobody waits for
any more lands in a discard buffer instead, and a RECV is never left behind for a reply that
never comes (RECVs are consumed in order: a stale one would misplace the next reply).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from smartgen.lanes.rdma.plan import Sge, chunk_sges, reply_sizes

__all__ = ["landing_chunks", "check_chunk_sizes", "MAX_REPLY_CHUNKS"]

MAX_REPLY_CHUNKS = 1 << 16  # a FETCH's reply in more RECVs than this is refused (a peer cannot make us post more)


def landing_chunks(
    ranges: Sequence[tuple[torch.Tensor, int, int]],
    locate: Callable[[torch.Tensor], tuple[int, int]],
    max_sge: int,
    max_msg_bytes: int,
) -> tuple[list[list[Sge]], list[int]]:
    """Scatter lists (one per RECV) for a reply whose bytes go to `ranges` in order, and their sizes.

    `ranges` are (flat uint8 region, byte offset, length); `locate(region)` gives the address the NIC
    knows the region's start by (its pointer; for GPU memory registered as a DMA-BUF, the MR's own
    base) and its lkey. Neighbouring ranges that continue each other merge into one element. A list is cut early so that no RECV takes more than
    `max_msg_bytes` (the port's largest message).
    """
    sges = []
    for region, offset, length in ranges:
        if not 0 <= offset <= offset + length <= region.numel():
            raise ValueError(f"landing range {offset}+{length} is outside its {region.numel()}-byte region")
        if length:
            base, lkey = locate(region)
            sges.append(Sge(base + offset, length, int(lkey)))
    chunks: list[list[Sge]] = []
    for chunk in chunk_sges(sges, max_sge):
        current: list[Sge] = []
        size = 0
        for sge in chunk:
            while sge.length:
                room = max_msg_bytes - size
                if room == 0:
                    chunks.append(current)
                    current, size = [], 0
                    continue
                take = min(room, sge.length)
                current.append(Sge(sge.addr, take, sge.lkey))
                size += take
                sge = Sge(sge.addr + take, sge.length - take, sge.lkey)
        if current:
            chunks.append(current)
    return chunks, reply_sizes(chunks)


def check_chunk_sizes(value: Any) -> list[int]:
    """A peer's `reply_chunks`/`scatter` list, checked: positive ints, not too many; ValueError otherwise."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_REPLY_CHUNKS:
        raise ValueError(f"reply chunk sizes must be a list of 1 to {MAX_REPLY_CHUNKS} sizes")
    if not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in value):
        raise ValueError("reply chunk sizes must be positive integers")
    return value
