"""Checked, keyword-argument launchers for the split/reorder and KV gather Triton kernels."""

from __future__ import annotations

import torch
import triton

from smartgen.engine.kernels import IndexSplit
from smartgen.engine.kernels.gather import gather_kv_kernel
from smartgen.engine.kernels.index_split import split_reorder_kernel

__all__ = ["split_reorder_triton", "gather_kv_triton"]

# A split tile holds BLOCK_R * BLOCK_K entries; this bounds it so registers do not spill.
_SPLIT_TILE = 4096
_GATHER_BLOCK_J = 16


def _device_of(t: torch.Tensor, name: str) -> torch.device:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t.device


def _check(t: torch.Tensor, name: str, dim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")


def split_reorder_triton(index: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, num_heads: int) -> IndexSplit:
    """Triton version of `split_reorder_reference`: status lookup plus stable remote-first reorder.

    index [R, k] int64 (R = B*H; entries outside [0, N) are padding), mask [S, N, H] int8 (one value per
    token and KV head; [S, N] when all heads share it), slots [B] int64. Returns an IndexSplit of new tensors on index's device.
    """
    device = _device_of(index, "index")
    _check(index, "index", 2, (torch.int64,), device)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        mask = mask.unsqueeze(-1).expand(-1, -1, num_heads)  # stride 0 over heads: no copy
    _check(mask, "mask", 3, (torch.int8,), device)
    _check(slots, "slots", 1, (torch.int64,), device)
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    num_rows, k = index.shape
    if num_rows != slots.shape[0] * num_heads:
        raise ValueError(
            f"index must be [B*H, k] = [{slots.shape[0] * num_heads}, k] for B={slots.shape[0]}, "
            f"H={num_heads}; got {tuple(index.shape)}"
        )
    if mask.shape[2] != num_heads:
        raise ValueError(f"mask must be [S, N, H={num_heads}], got {tuple(mask.shape)}")

    out_index = torch.empty_like(index, memory_format=torch.contiguous_format)  # [R, k]
    out_status = torch.empty((num_rows, k), dtype=torch.int8, device=device)  # [R, k]
    num_remote = torch.zeros(num_rows, dtype=torch.int32, device=device)  # [R]
    num_local = torch.zeros(num_rows, dtype=torch.int32, device=device)  # [R]
    if num_rows == 0 or k == 0:
        return IndexSplit(out_index, out_status, num_remote, num_local)

    block_k = triton.next_power_of_2(k)
    block_r = max(1, min(16, _SPLIT_TILE // block_k))
    grid = (triton.cdiv(num_rows, block_r),)
    split_reorder_kernel[grid](
        index,
        mask,
        slots,
        out_index,
        out_status,
        num_remote,
        num_local,
        num_rows,
        k,
        mask.shape[1],
        num_heads,
        index.stride(0),
        index.stride(1),
        mask.stride(0),
        mask.stride(1),
        mask.stride(2),
        slots.stride(0),
        out_index.stride(0),
        out_index.stride(1),
        out_status.stride(0),
        out_status.stride(1),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    return IndexSplit(out_index, out_status, num_remote, num_local)


def gather_kv_triton(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    index: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> None:
    """Triton version of `gather_kv_reference`: out[r, j] = pool[slot(r // H), index[r, j], r % H].

    k_pool / v_pool [S, N, H, d] (any strides), slots [B] int64, index [R, k] int64,
    start / stop [R] int32 or int64, k_out / v_out [R, k, d] of the pool dtype. Only
    start[r] <= j < stop[r] is written; window entries outside [0, N) are skipped (the
    reference would wrap -1 or raise), so callers keep windows on valid positions.
    """
    device = _device_of(k_pool, "k_pool")
    _check(k_pool, "k_pool", 4, (k_pool.dtype,), device)
    _check(v_pool, "v_pool", 4, (k_pool.dtype,), device)
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool shape {tuple(v_pool.shape)} differs from k_pool shape {tuple(k_pool.shape)}")
    num_slots, num_tokens, num_heads, head_dim = k_pool.shape
    _check(slots, "slots", 1, (torch.int64,), device)
    _check(index, "index", 2, (torch.int64,), device)
    num_rows, k = index.shape
    if num_rows != slots.shape[0] * num_heads:
        raise ValueError(
            f"index must be [B*H, k] = [{slots.shape[0] * num_heads}, k] for B={slots.shape[0]}, "
            f"H={num_heads}; got {tuple(index.shape)}"
        )
    for name, t in (("start", start), ("stop", stop)):
        _check(t, name, 1, (torch.int32, torch.int64), device)
        if t.shape[0] != num_rows:
            raise ValueError(f"{name} must be [R] = [{num_rows}], got {tuple(t.shape)}")
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        _check(t, name, 3, (k_pool.dtype,), device)
        if tuple(t.shape) != (num_rows, k, head_dim):
            raise ValueError(f"{name} must be [R, k, d] = [{num_rows}, {k}, {head_dim}], got {tuple(t.shape)}")
    if num_rows == 0 or k == 0 or head_dim == 0:
        return

    block_j = min(_GATHER_BLOCK_J, triton.next_power_of_2(k))
    grid = (num_rows, triton.cdiv(k, block_j))
    gather_kv_kernel[grid](
        k_pool,
        v_pool,
        slots,
        index,
        start,
        stop,
        k_out,
        v_out,
        k,
        num_tokens,
        num_heads,
        head_dim,
        *k_pool.stride(),
        *v_pool.stride(),
        slots.stride(0),
        index.stride(0),
        index.stride(1),
        start.stride(0),
        stop.stride(0),
        *k_out.stride(),
        *v_out.stride(),
        BLOCK_J=block_j,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
