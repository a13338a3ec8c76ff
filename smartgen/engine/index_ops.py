"""Splits a decode step's KV index by mask into remote and local lanes and gathers the selected KV.

These PyTorch functions are the CPU path and the reference every Triton kernel in
`smartgen.engine.kernels` is tested against. Shapes, with R = B·H rows (row r is batch r // H,
KV head r % H), k selected entries per row, S pool slots, N tokens per slot:

    index   [R, k]     int64  token positions; -1 (or any position outside [0, N)) = no entry
    mask    [S, N, H]  int8   0 = padding, 1 = local, 2 = remote, per token and KV head (one layer of the
                              mask table); [S, N] when every head shares the token's value
    slots   [B]        int64  pool slot of each batch entry
    pool    [S, N, H, d]      one layer of the decode pool's K or V (token-major)
"""

from __future__ import annotations

import torch

from smartgen.engine.kernels import IndexSplit
from smartgen.engine.mask import LOCAL, REMOTE

__all__ = [
    "IndexSplit",
    "entry_status",
    "split_reorder_reference",
    "split_reorder_cpu",
    "split_all_local",
    "gather_kv_reference",
    "gather_valid_reference",
    "split_reorder",
    "gather_kv",
    "gather_valid",
    "distinct_in_order",
]


def entry_status(index: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Operator (1): status = mask[slot(b), index, head(r)] -> [R, k] int8, 0 for out-of-range entries."""
    num_tokens = mask.shape[1]
    invalid = (index < 0) | (index >= num_tokens)
    safe = index.clamp(0, num_tokens - 1)
    row_slot = slots.repeat_interleave(num_heads)  # [R]
    if mask.is_contiguous():
        # one flat read of the mask: (slot, token, head) -> (slot * N + token) * H + head, a [S, N] mask with H = 1
        heads = num_heads if mask.dim() == 3 else 1
        base = row_slot * (num_tokens * heads)
        if heads > 1:
            base = base + torch.arange(num_heads, device=index.device).repeat(slots.shape[0])  # row r is head r % H
        flat = safe * heads + base.unsqueeze(1)
        status = mask.view(-1).index_select(0, flat.view(-1)).view(index.shape)
    else:
        if mask.dim() == 2:
            mask = mask.unsqueeze(-1).expand(-1, -1, num_heads)
        row_head = torch.arange(num_heads, device=index.device).repeat(slots.shape[0])  # [R]: row r is head r % H
        status = mask[row_slot.unsqueeze(1).expand_as(index), safe, row_head.unsqueeze(1).expand_as(index)]
    return status.to(torch.int8).masked_fill_(invalid, 0)


def split_reorder_reference(index: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, num_heads: int) -> IndexSplit:
    """Operators (1)-(5) of the on-demand path: status, local/remote split, stable remote-first reorder.

    The reorder is a stable partition of each row into remote, local, then everything else (padding), as a stable
    descending sort by status would give for mask values 0-2; counted with prefix sums rather than sorted, so it
    costs a few passes over the index (a sort of a 32K-token step's 26K entries per layer took 0.4 ms on the CPU).
    """
    _check_index(index, slots, num_heads)
    return _split_by_status(index, entry_status(index, mask, slots, num_heads))


def _check_index(index: torch.Tensor, slots: torch.Tensor, num_heads: int) -> None:
    if index.dim() != 2 or index.shape[0] != slots.shape[0] * num_heads:
        raise ValueError(f"index must be [B*H, k] = [{slots.shape[0] * num_heads}, k], got {tuple(index.shape)}")


def _split_by_status(index: torch.Tensor, status: torch.Tensor) -> IndexSplit:
    """The partition of `split_reorder_reference`, from each entry's status."""
    if index.shape[1] == 0:
        empty = torch.zeros(index.shape[0], dtype=torch.int32, device=index.device)
        return IndexSplit(index.clone(), status, empty, empty.clone())
    remote, local = status == REMOTE, status == LOCAL
    remote_rank, local_rank = remote.cumsum(1), local.cumsum(1)  # [R, k]: how many of each up to and at j
    num_remote, num_local = remote_rank[:, -1:], local_rank[:, -1:]  # [R, 1]
    # where entry j goes: its rank among the remote, after the remote among the local, after both among the rest
    # (j - earlier remote - earlier local)
    column = torch.arange(index.shape[1], device=index.device)
    dest = torch.where(
        remote,
        remote_rank - 1,
        torch.where(local, num_remote + local_rank - 1, num_remote + num_local + column - remote_rank - local_rank),
    )
    return IndexSplit(
        index=torch.empty_like(index).scatter_(1, dest, index),
        status=torch.empty_like(status).scatter_(1, dest, status),
        num_remote=num_remote.squeeze(1).to(torch.int32),
        num_local=num_local.squeeze(1).to(torch.int32),
    )


def split_reorder_cpu(index: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, num_heads: int) -> IndexSplit:
    """`split_reorder_reference`, cheaper where nothing selected is remote: once the prefetch, hints and speculation
    have brought a layer's picks, a step reads their status and finds every one local, though the layer still holds
    remote tokens elsewhere. Then the entries keep their order (local first, padding after) and the partition's
    prefix sums and scatters are skipped, as in `split_all_local`."""
    _check_index(index, slots, num_heads)
    status = entry_status(index, mask, slots, num_heads)
    if index.shape[1] == 0 or bool((status == REMOTE).any()):
        return _split_by_status(index, status)
    return _local_first(index, status, status == LOCAL)


def _local_first(index: torch.Tensor, status: torch.Tensor, local: torch.Tensor) -> IndexSplit:
    """The split of rows with no remote entry: the `local` entries first, in order, then the rest (padding). A
    selector pads each row at its end only, so the stable partition runs only where padding comes before an entry."""
    num_local = local.sum(1, dtype=torch.int32)
    if index.shape[1] > 1 and bool((local[:, 1:] & ~local[:, :-1]).any()):  # padding before an entry: partition
        order = torch.sort((~local).to(torch.uint8), dim=1, stable=True).indices
        index, status = torch.gather(index, 1, order), torch.gather(status, 1, order)
    return IndexSplit(index, status, torch.zeros_like(num_local), num_local)


def split_all_local(index: torch.Tensor, row_length: torch.Tensor) -> IndexSplit:
    """What `split_reorder_reference` gives when row r's request holds every position in [0, row_length[r]) local
    and none past it (its prompt has all landed; generated tokens are local at once), read without the mask: the
    entries in range first, in order, then the rest. A selector pads each row at its end only, so the reorder is
    skipped unless padding comes before an entry. On this CPU (2K tokens, 10%) it took 16-27 us a layer where the
    general split took 115-191 (batch 1-4): full transfer's every layer, and SmartGen's once its KV is whole."""
    valid = (index >= 0) & (index < row_length.unsqueeze(1))
    return _local_first(index, valid.to(torch.int8) * LOCAL, valid)


def gather_kv_reference(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    index: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> None:
    """Copies pool[slot(b), index[r, j], r % H] into out[r, j] for start[r] <= j < stop[r].

    k_out / v_out are [R, k, d]; entries outside [start, stop) are left untouched, so the
    local and the remote lane can fill disjoint parts of the same rows.
    """
    num_slots, num_tokens, num_heads, head_dim = k_pool.shape
    num_rows, k = index.shape
    cols = torch.arange(k, device=index.device).unsqueeze(0)
    take = (cols >= start.unsqueeze(1)) & (cols < stop.unsqueeze(1))  # [R, k]
    flat_take = take.view(-1).nonzero().squeeze(1)  # [T] positions in the [R·k] output rows
    if flat_take.numel() == 0:
        return
    # One flat row id per taken entry into the pool seen as [S·N·H, d]: (slot * N + token) * H + head, computed for
    # the taken entries only (a step at 32K tokens gathers 26K entries a layer in two or three calls)
    row_base = slots.repeat_interleave(num_heads) * (num_tokens * num_heads) + torch.arange(
        num_heads, device=index.device
    ).repeat(slots.shape[0])  # [R]
    pool_row = index.reshape(-1).index_select(0, flat_take) * num_heads + row_base.index_select(0, flat_take // k)
    for pool, out in ((k_pool, k_out), (v_pool, v_out)):
        values = pool.reshape(-1, head_dim).index_select(0, pool_row)  # a view when the pool is contiguous
        if out.is_contiguous():
            out.view(-1, head_dim).index_copy_(0, flat_take, values)
        else:
            r, j = flat_take // k, flat_take % k
            out[r, j] = values


def gather_valid_reference(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    index: torch.Tensor,
    num_valid: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> None:
    """out[r, j] = pool[slot(b), index[r, j], r % H] for j < num_valid[r], zero for the rest (padding): what
    zeroed outputs and `gather_kv_reference` over [0, num_valid) give. Every entry of the [R, k] grid is read in
    one gather (padding from a clamped position, then zeroed), not the taken ones picked out and scattered: the
    scatter (`index_copy_`) cost 3x the gather (a batch of 4 at 2K tokens: 6.9K entries, 143 against 47 us on
    this CPU). Entries [0, num_valid) must be positions in [0, N) (a split's remote and local entries are)."""
    num_slots, num_tokens, num_heads, head_dim = k_pool.shape
    num_rows, k = index.shape
    if not (k_out.is_contiguous() and v_out.is_contiguous()):
        k_out.zero_()
        v_out.zero_()
        zeros = torch.zeros_like(num_valid)
        gather_kv_reference(k_pool, v_pool, slots, index, zeros, num_valid, k_out, v_out)
        return
    row_base = slots.repeat_interleave(num_heads) * (num_tokens * num_heads) + torch.arange(
        num_heads, device=index.device
    ).repeat(slots.shape[0])  # [R]
    pool_row = (index.clamp(0, num_tokens - 1) * num_heads + row_base.unsqueeze(1)).view(-1)
    # padding as row ids of the [R·k, d] outputs: index_fill_ on them took 38 us where a broadcast masked_fill_
    # took 194 (fp16, the shapes above)
    padding = (torch.arange(k, device=index.device).unsqueeze(0) >= num_valid.unsqueeze(1)).view(-1).nonzero()
    for pool, out in ((k_pool, k_out), (v_pool, v_out)):
        rows = out.view(-1, head_dim)
        torch.index_select(pool.reshape(-1, head_dim), 0, pool_row, out=rows)
        rows.index_fill_(0, padding.squeeze(1), 0)


def split_reorder(
    index: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    all_local_lengths: torch.Tensor | None = None,
) -> IndexSplit:
    """Dispatches to the Triton kernel on CUDA (or when forced), else the PyTorch reference; `all_local_lengths`
    [R] (each row's request has positions [0, length) all local, the caller knows): `split_all_local` off CUDA,
    where the kernel's one pass would beat its few operations."""
    from smartgen.engine.kernels import use_triton

    if use_triton(index):
        from smartgen.engine.kernels.launch import split_reorder_triton

        return split_reorder_triton(index, mask, slots, num_heads)
    if all_local_lengths is not None:
        return split_all_local(index, all_local_lengths)
    return split_reorder_cpu(index, mask, slots, num_heads)


def gather_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    index: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> None:
    """Dispatches to the Triton kernel on CUDA (or when forced), else the PyTorch reference."""
    from smartgen.engine.kernels import use_triton

    if use_triton(k_pool):
        from smartgen.engine.kernels.launch import gather_kv_triton

        gather_kv_triton(k_pool, v_pool, slots, index, start, stop, k_out, v_out)
    else:
        gather_kv_reference(k_pool, v_pool, slots, index, start, stop, k_out, v_out)


def gather_valid(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    index: torch.Tensor,
    num_valid: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> None:
    """Fills k_out / v_out whole: entries [0, num_valid) of each row from the pool, zero after. On CUDA (or when
    forced) the outputs are zeroed and the Triton gather kernel copies [0, num_valid); else the reference."""
    from smartgen.engine.kernels import use_triton

    if use_triton(k_pool):
        from smartgen.engine.kernels.launch import gather_kv_triton

        k_out.zero_()
        v_out.zero_()
        gather_kv_triton(k_pool, v_pool, slots, index, torch.zeros_like(num_valid), num_valid, k_out, v_out)
    else:
        gather_valid_reference(k_pool, v_pool, slots, index, num_valid, k_out, v_out)


def distinct_in_order(ids: torch.Tensor) -> torch.Tensor:
    """`ids` [n] without repeats, each where it first occurs (`unique` would sort them)."""
    if ids.numel() < 2:
        return ids
    distinct, inverse = torch.unique(ids, return_inverse=True)
    positions = torch.arange(ids.numel(), device=ids.device)
    first = torch.full_like(distinct, ids.numel()).scatter_reduce_(0, inverse, positions, "amin")
    return ids.index_select(0, first.sort().values)
