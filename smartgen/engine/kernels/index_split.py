"""Triton kernel: looks up each index entry's mask value and reorders the row remote-first."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_reorder_kernel(
    index_ptr,  # [R, k] int64
    mask_ptr,  # [S, N, H] int8
    slots_ptr,  # [B] int64
    out_index_ptr,  # [R, k] int64
    out_status_ptr,  # [R, k] int8
    num_remote_ptr,  # [R] int32
    num_local_ptr,  # [R] int32
    num_rows,
    k,
    num_tokens,
    num_heads,
    stride_ir,
    stride_ik,
    stride_ms,
    stride_mn,
    stride_mh,
    stride_slot,
    stride_or,
    stride_ok,
    stride_sr,
    stride_sk,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per BLOCK_R rows; a row's k entries fit in one BLOCK_K tile."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    row_ok = rows < num_rows
    live = row_ok[:, None] & (cols[None, :] < k)  # [BLOCK_R, BLOCK_K]

    pos = tl.load(index_ptr + rows[:, None] * stride_ir + cols[None, :] * stride_ik, mask=live, other=-1)
    slot = tl.load(slots_ptr + (rows // num_heads) * stride_slot, mask=row_ok, other=0)  # [BLOCK_R]
    valid = live & (pos >= 0) & (pos < num_tokens)
    head = rows % num_heads  # row r is KV head r % H
    mask_at = mask_ptr + slot[:, None] * stride_ms + pos * stride_mn + head[:, None] * stride_mh
    status = tl.load(mask_at, mask=valid, other=0).to(tl.int32)

    # Stable partition by exclusive prefix sums: entry i's destination is the number of
    # same-lane entries before it plus the sizes of the lanes ahead of its lane. This is
    # the reference's stable descending sort for mask values in {PAD, LOCAL, REMOTE}.
    is_remote = (live & (status == 2)).to(tl.int32)
    is_local = (live & (status == 1)).to(tl.int32)
    is_pad = (live & (status != 2) & (status != 1)).to(tl.int32)
    num_remote = tl.sum(is_remote, axis=1)  # [BLOCK_R]
    num_local = tl.sum(is_local, axis=1)
    before_remote = tl.cumsum(is_remote, axis=1) - is_remote
    before_local = tl.cumsum(is_local, axis=1) - is_local
    before_pad = tl.cumsum(is_pad, axis=1) - is_pad
    dest = tl.where(
        is_remote != 0,
        before_remote,
        tl.where(is_local != 0, num_remote[:, None] + before_local, (num_remote + num_local)[:, None] + before_pad),
    )  # [BLOCK_R, BLOCK_K], a permutation of 0..k-1 on each live row

    tl.store(out_index_ptr + rows[:, None] * stride_or + dest * stride_ok, pos, mask=live)
    tl.store(out_status_ptr + rows[:, None] * stride_sr + dest * stride_sk, status.to(tl.int8), mask=live)
    tl.store(num_remote_ptr + rows, num_remote, mask=row_ok)
    tl.store(num_local_ptr + rows, num_local, mask=row_ok)
