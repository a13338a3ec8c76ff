"""Triton kernel: copies the selected K and V pool rows of each (batch, head) row into dense outputs."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_kv_kernel(
    k_pool_ptr,  # [S, N, H, d]
    v_pool_ptr,  # [S, N, H, d]
    slots_ptr,  # [B] int64
    index_ptr,  # [R, k] int64
    start_ptr,  # [R] int32 or int64
    stop_ptr,  # [R] int32 or int64
    k_out_ptr,  # [R, k, d]
    v_out_ptr,  # [R, k, d]
    k,
    num_tokens,
    num_heads,
    head_dim,
    stride_ks,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_slot,
    stride_ir,
    stride_ik,
    stride_start,
    stride_stop,
    stride_kor,
    stride_kok,
    stride_kod,
    stride_vor,
    stride_vok,
    stride_vod,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (R, cdiv(k, BLOCK_J)): one program copies up to BLOCK_J entries of one row."""
    row = tl.program_id(0).to(tl.int64)
    js = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)  # [BLOCK_J]
    ds = tl.arange(0, BLOCK_D)  # [BLOCK_D]

    start = tl.load(start_ptr + row * stride_start).to(tl.int64)
    stop = tl.load(stop_ptr + row * stride_stop).to(tl.int64)
    slot = tl.load(slots_ptr + (row // num_heads) * stride_slot)
    head = row % num_heads

    take = (js < k) & (js >= start) & (js < stop)
    pos = tl.load(index_ptr + row * stride_ir + js * stride_ik, mask=take, other=0)
    # The caller keeps windows on valid positions; this only keeps a bad one from reading out of bounds.
    take = take & (pos >= 0) & (pos < num_tokens)
    tile = take[:, None] & (ds[None, :] < head_dim)  # [BLOCK_J, BLOCK_D]

    k_src = k_pool_ptr + slot * stride_ks + head * stride_kh + pos[:, None] * stride_kn + ds[None, :] * stride_kd
    v_src = v_pool_ptr + slot * stride_vs + head * stride_vh + pos[:, None] * stride_vn + ds[None, :] * stride_vd
    k_dst = k_out_ptr + row * stride_kor + js[:, None] * stride_kok + ds[None, :] * stride_kod
    v_dst = v_out_ptr + row * stride_vor + js[:, None] * stride_vok + ds[None, :] * stride_vod
    tl.store(k_dst, tl.load(k_src, mask=tile), mask=tile)
    tl.store(v_dst, tl.load(v_src, mask=tile), mask=tile)
