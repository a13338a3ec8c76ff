"""Plans RDMA work requests, with no verbs in sight: WRITE lists in doorbell batches with selective signalling,
send-queue accounting, and scatter lists (SGEs) for the fetch reply chunked to the device's max_sge.

A push is one ordered list of WRITEs on one RC queue pair (a block's K and V, then its mask):
RC delivers them in order, so the mask never lands before its data. Only every
`signal_every`-th WRITE and the last one ask for a completion; a signalled completion also
retires every unsignalled WRITE posted before it, which is what frees their send-queue slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from smartgen.lanes.transport import Segment

__all__ = [
    "Sge",
    "WriteWR",
    "QueueLimits",
    "split_long",
    "plan_writes",
    "SendQueue",
    "merge_sges",
    "chunk_sges",
    "reply_sizes",
]


@dataclass(frozen=True, slots=True)
class Sge:
    """One scatter/gather element: `length` bytes at `addr` in the memory region with `lkey`."""

    addr: int
    length: int
    lkey: int


@dataclass(frozen=True, slots=True)
class WriteWR:
    """One RDMA WRITE work request (one SGE: the lane's descriptors are contiguous on both sides)."""

    wr_id: int
    sge: Sge
    remote_addr: int
    rkey: int
    signaled: bool


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """What the device and the QP allow (ibv_query_device / ibv_query_port / the QP caps)."""

    max_send_wr: int  # send-queue depth
    max_sge: int  # SGEs per work request
    max_msg_bytes: int = 2**31  # the port's max_msg_sz
    signal_every: int = 64  # requested cadence; capped by the queue depth
    max_post: int = 32  # work requests per doorbell (one ibv_post_send call)

    def __post_init__(self) -> None:
        if min(self.max_send_wr, self.max_sge, self.max_msg_bytes, self.signal_every, self.max_post) < 1:
            raise ValueError(f"queue limits must be positive: {self}")

    @property
    def signal_interval(self) -> int:
        # at most half the queue may wait unsignalled, or the queue can fill with slots no completion frees
        return max(1, min(self.signal_every, self.max_send_wr // 2))

    @property
    def batch_size(self) -> int:
        return max(1, min(self.max_post, self.signal_interval))


def split_long(segments: Sequence[Segment], max_msg_bytes: int) -> list[Segment]:
    """Cuts segments longer than one message may be, in order."""
    out = []
    for s in segments:
        for start in range(0, s.length, max_msg_bytes):
            length = min(max_msg_bytes, s.length - start)
            out.append(Segment(s.src_addr + start, s.dst_addr + start, length, s.src_key, s.dst_key))
    return out


def plan_writes(segments: Sequence[Segment], limits: QueueLimits, first_wr_id: int = 0) -> list[list[WriteWR]]:
    """Doorbell batches of WRITEs for one write list; src_key/dst_key must be the lkey/rkey.

    Every batch ends with a signalled WRITE, so waiting for a batch's last completion
    retires all of it; within a batch no run of unsignalled WRITEs is longer than the interval.
    """
    pieces = split_long(segments, limits.max_msg_bytes)
    size = limits.batch_size
    batches = []
    for start in range(0, len(pieces), size):
        chunk = pieces[start : start + size]
        batches.append(
            [
                WriteWR(
                    first_wr_id + start + i,
                    Sge(p.src_addr, p.length, int(p.src_key)),
                    p.dst_addr,
                    int(p.dst_key),
                    signaled=i == len(chunk) - 1,
                )
                for i, p in enumerate(chunk)
            ]
        )
    return batches


class SendQueue:
    """Send-queue slots in use: a post must fit, and a signalled completion frees its WR and all before it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._posted: list[int] = []  # wr_ids in posting order, not yet retired

    @property
    def in_use(self) -> int:
        return len(self._posted)

    def fits(self, batch: Sequence[WriteWR]) -> bool:
        return self.in_use + len(batch) <= self.depth

    def posted(self, batch: Sequence[WriteWR]) -> None:
        self.posted_ids([wr.wr_id for wr in batch])

    def posted_ids(self, wr_ids: Sequence[int]) -> None:
        if self.in_use + len(wr_ids) > self.depth:
            raise RuntimeError(f"send queue overflow: {self.in_use} + {len(wr_ids)} > {self.depth}")
        self._posted.extend(wr_ids)

    def holds(self, wr_id: int) -> bool:
        return wr_id in self._posted

    def completed(self, wr_id: int) -> int:
        """A signalled WR completed: retires it and every WR posted before it; returns how many."""
        if wr_id not in self._posted:
            raise KeyError(f"completion for unknown work request {wr_id}")
        count = self._posted.index(wr_id) + 1
        del self._posted[:count]
        return count


def merge_sges(sges: Sequence[Sge]) -> list[Sge]:
    """Joins neighbours that continue each other in the same memory region."""
    merged: list[Sge] = []
    for sge in sges:
        if sge.length <= 0:
            continue
        last = merged[-1] if merged else None
        if last is not None and last.lkey == sge.lkey and last.addr + last.length == sge.addr:
            merged[-1] = Sge(last.addr, last.length + sge.length, last.lkey)
        else:
            merged.append(sge)
    return merged


def chunk_sges(sges: Sequence[Sge], max_sge: int) -> list[list[Sge]]:
    """Scatter lists of at most `max_sge` elements, one per RECV; the sender cuts its reply at the same sizes.

    For the fetch reply, each element is the start of one reordered index row (its remote
    entries are contiguous there), so one RECV scatters a chunk of rows in place.
    """
    if max_sge < 1:
        raise ValueError("max_sge must be positive")
    merged = merge_sges(sges)
    return [merged[i : i + max_sge] for i in range(0, len(merged), max_sge)]


def reply_sizes(chunks: Sequence[Sequence[Sge]]) -> list[int]:
    """The SEND sizes that match a list of RECV scatter lists, chunk for chunk."""
    return [sum(s.length for s in chunk) for chunk in chunks]
