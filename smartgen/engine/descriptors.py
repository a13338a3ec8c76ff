"""Turns KV blocks of a request into one-sided write descriptors: K and V runs, then their mask runs.

Adjacent blocks of a layer are merged into one run before descriptors are made, so a
layer pushed whole is three descriptors (K, V, mask), not 3·M.
"""

from __future__ import annotations

import torch

from smartgen.engine.layout import block_bounds, token_blocks
from smartgen.engine.pool import PoolGeometry, RequestKV
from smartgen.lanes.base import WriteOp

__all__ = [
    "block_runs",
    "token_runs",
    "bridge_runs",
    "held_blocks",
    "block_wants",
    "block_write_ops",
    "token_write_ops",
    "entry_write_ops",
    "block_entries",
    "ONES_SOURCE",
]

ONES_SOURCE = "ones"  # the sender's source buffer of int8 ones used for mask writes (one per token and KV head)


def block_runs(blocks: torch.Tensor) -> list[tuple[int, int]]:
    """Ascending block ids -> maximal runs [(first, last + 1), ...] of consecutive blocks."""
    if blocks.numel() == 0:
        return []
    ids = blocks.sort().values.tolist()
    runs: list[tuple[int, int]] = []
    start = prev = ids[0]
    for block in ids[1:]:
        if block != prev + 1:
            runs.append((start, prev + 1))
            start = block
        prev = block
    runs.append((start, prev + 1))
    return runs


def token_runs(want: torch.Tensor) -> list[tuple[int, int]]:
    """Bool [n] -> maximal runs [(start, stop), ...] of True tokens."""
    edges = torch.diff(torch.nn.functional.pad(want.to(torch.int8), (1, 1))).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def bridge_runs(runs: list[tuple[int, int]], max_gap: int, resendable: torch.Tensor) -> list[tuple[int, int]]:
    """Merges consecutive runs whose gap is at most `max_gap` tokens, all of them `resendable` (bool [n]).

    Sending a short gap again costs its bytes; sending it as two runs costs three more descriptors (K, V,
    mask). On a fast link the bytes are the cheaper, and resending is safe where the bytes are the same:
    tokens this node sent in the same request (not ones the decode node holds from elsewhere).
    """
    if max_gap <= 0 or len(runs) < 2:
        return runs
    merged = [runs[0]]
    for start, stop in runs[1:]:
        prev_start, prev_stop = merged[-1]
        if start - prev_stop <= max_gap and bool(resendable[prev_stop:start].all()):
            merged[-1] = (prev_start, stop)
        else:
            merged.append((start, stop))
    return merged


def held_blocks(held: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[L, n] bool held tokens -> [L, M_eff] bool: the blocks every token of which is held."""
    blocks = token_blocks(held.shape[1], num_blocks).expand(held.shape[0], -1)
    m_eff = int(blocks[0, -1]) + 1 if held.shape[1] else 0
    full = torch.ones(held.shape[0], m_eff, dtype=torch.bool)
    return full.scatter_reduce(1, blocks, held, "amin")


def block_write_ops(
    geometry: PoolGeometry,
    entry: RequestKV,
    slot: int,
    layer_blocks: list[tuple[int, torch.Tensor]],
    unsent: torch.Tensor | None = None,
    bridge_tokens: int = 0,
    resendable: torch.Tensor | None = None,
) -> tuple[list[WriteOp], int]:
    """Descriptors for pushing `layer_blocks` [(layer, block ids)] of one request into a pool slot.

    All data descriptors come before all mask descriptors, so in one in-order batch no mask
    entry turns local before its bytes are in. With `unsent` ([L, n] bool, or [L, n, H] per KV head) only its
    True tokens (entries) are written:
    a token the decode node already holds (its prefix cache) or was already sent (a
    fetch, an earlier push) never crosses the link twice (per head with [L, n, H]), except gaps of at most
    `bridge_tokens` tokens that `resendable` ([L, n] bool, or [L, n, H] with a per-head `unsent`) allows, which are sent again to save descriptors (`bridge_runs`).
    Returns (ops, KV bytes).
    """
    return token_write_ops(
        geometry, entry, slot, block_wants(entry.length, geometry, layer_blocks), unsent, bridge_tokens, resendable
    )


def block_wants(
    length: int, geometry: PoolGeometry, layer_blocks: list[tuple[int, torch.Tensor]]
) -> list[tuple[int, torch.Tensor]]:
    """[(layer, block ids)] -> [(layer, [n] bool)]: the tokens of those blocks."""
    bounds = block_bounds(length, geometry.layout.num_blocks).tolist()
    wants = []
    for layer, blocks in layer_blocks:
        want = torch.zeros(length, dtype=torch.bool)
        for first, stop in block_runs(blocks):
            want[bounds[first] : bounds[stop]] = True
        wants.append((layer, want))
    return wants


def token_write_ops(
    geometry: PoolGeometry,
    entry: RequestKV,
    slot: int,
    layer_wants: list[tuple[int, torch.Tensor]],
    unsent: torch.Tensor | None = None,
    bridge_tokens: int = 0,
    resendable: torch.Tensor | None = None,
) -> tuple[list[WriteOp], int]:
    """`block_write_ops` for any tokens: [(layer, [n] bool wanted)], each maximal run one K, V and mask write; a
    want of [n, H] names (token, head) entries (hints) and needs a per-head `unsent`.

    With a per-head `unsent` ([L, n, H]) the runs are of (token, head) entries: a token's heads are adjacent in
    K, V and the mask, so entry t * H + h sits at that many head widths from the layer's start, and a push sends
    only the heads no fetch sent (measured: pushing whole tokens resent every head a fetch had brought, 4 of the
    20 MiB a 16-layer request's link carried). `bridge_tokens` counts tokens either way."""
    per_head = unsent is not None and unsent.dim() == 3
    layers = [layer for layer, _ in layer_wants]
    if per_head and not (bridge_tokens > 0 and resendable is not None) and len(set(layers)) == len(layers) > 1:
        assert unsent is not None
        return _entry_write_ops(geometry, entry, slot, layer_wants, unsent)
    return _layer_write_ops(geometry, entry, slot, layer_wants, unsent, bridge_tokens, resendable)


def _layer_write_ops(
    geometry: PoolGeometry,
    entry: RequestKV,
    slot: int,
    layer_wants: list[tuple[int, torch.Tensor]],
    unsent: torch.Tensor | None,
    bridge_tokens: int,
    resendable: torch.Tensor | None,
) -> tuple[list[WriteOp], int]:
    """`token_write_ops` a layer at a time (any want, bridging)."""
    token_bytes = geometry.layout.token_bytes
    heads = geometry.layout.num_kv_heads  # mask bytes per token
    data: list[WriteOp] = []
    masks: list[WriteOp] = []
    kv_bytes = 0
    for layer, want in layer_wants:
        per_head = unsent is not None and unsent.dim() == 3
        units = heads if per_head else 1  # runs are counted in tokens, or in (token, head) entries
        if unsent is None:
            spans = token_runs(want)
        else:
            wanted = (
                ((want if want.dim() == 2 else want[:, None]) & unsent[layer]).flatten()
                if per_head
                else want & unsent[layer]
            )
            spans = token_runs(wanted)
            if bridge_tokens > 0 and resendable is not None:
                spans = bridge_runs(spans, bridge_tokens * units, resendable[layer].flatten())
        unit_bytes, unit_mask = token_bytes // units, heads // units
        src_base, dst_base = entry.kv_offset(layer, 0), geometry.kv_offset(layer, slot, 0)
        mask_base = geometry.mask_offset(layer, slot, 0)
        for start, stop in spans:
            num_bytes = (stop - start) * unit_bytes
            src, dst = src_base + start * unit_bytes, dst_base + start * unit_bytes
            data.append(WriteOp("k", "k", src, dst, num_bytes))
            data.append(WriteOp("v", "v", src, dst, num_bytes))
            masks.append(WriteOp(ONES_SOURCE, "mask", 0, mask_base + start * unit_mask, (stop - start) * unit_mask))
            kv_bytes += 2 * num_bytes
    return data + masks, kv_bytes


def _entry_write_ops(
    geometry: PoolGeometry,
    entry: RequestKV,
    slot: int,
    layer_wants: list[tuple[int, torch.Tensor]],
    unsent: torch.Tensor,
) -> tuple[list[WriteOp], int]:
    """`token_write_ops` with a per-head `unsent` and no bridging, every layer at once: the runs of wanted unsent
    (token, head) entries found by one diff over all the layers' rows, not a few small operations per layer (a
    hinted slice touches most layers with a few entries each: 30 layers cost 2.8 ms a slice, a layer at a time).
    The same descriptors in the same order as `_layer_write_ops`."""
    heads = geometry.layout.num_kv_heads
    layers = [layer for layer, _ in layer_wants]
    wants = torch.stack([want if want.dim() == 2 else want[:, None].expand(-1, heads) for _, want in layer_wants])
    wanted = (wants & unsent[layers]).flatten(1).to(torch.int8)  # [k, n * H]: one row per layer, entries in order
    edges = torch.diff(torch.nn.functional.pad(wanted, (1, 1)), dim=1).nonzero()  # row-major: layer, then position
    starts, stops = edges[0::2, 1], edges[1::2, 1]
    run_layers = [layers[row] for row in edges[0::2, 0].tolist()]
    return _entry_run_ops(geometry, entry, slot, run_layers, starts.tolist(), (stops - starts).tolist())


def _entry_run_ops(
    geometry: PoolGeometry, entry: RequestKV, slot: int, layers: list[int], starts: list[int], counts: list[int]
) -> tuple[list[WriteOp], int]:
    """The K, V and mask writes of runs of (token, head) entries, in order, all data before all masks: run i is
    `counts[i]` entries of layer `layers[i]` from entry `starts[i]` (token * H + head) on."""
    unit_bytes = geometry.layout.token_bytes // geometry.layout.num_kv_heads
    bases = {
        layer: (entry.kv_offset(layer, 0), geometry.kv_offset(layer, slot, 0), geometry.mask_offset(layer, slot, 0))
        for layer in dict.fromkeys(layers)
    }
    data: list[WriteOp] = []
    masks: list[WriteOp] = []
    kv_bytes = 0
    for start, count, layer in zip(starts, counts, layers):
        num_bytes = count * unit_bytes
        src_base, dst_base, mask_base = bases[layer]
        src, dst = src_base + start * unit_bytes, dst_base + start * unit_bytes
        data.append(WriteOp("k", "k", src, dst, num_bytes))
        data.append(WriteOp("v", "v", src, dst, num_bytes))
        masks.append(WriteOp(ONES_SOURCE, "mask", 0, mask_base + start, count))
        kv_bytes += 2 * num_bytes
    return data + masks, kv_bytes


def entry_write_ops(
    geometry: PoolGeometry, entry: RequestKV, slot: int, ids: torch.Tensor
) -> tuple[list[WriteOp], int]:
    """Descriptors for pushing flat (token, head) entries `ids` ((layer * n + token) * H + head; sorted, distinct, every
    one wanted and unsent) of one request into a pool slot: each maximal run of consecutive entries within a layer one
    K, V and mask write, all data before all masks. The same descriptors, in the same order, as `token_write_ops`
    makes from those entries as per-layer [n, H] wants over a per-head unsent mask, but from the ids alone: a hinted
    slice names a few entries in most layers, and per-layer wants cost the prefill node a zeroed [L, n, H] mask and
    a few tensor operations per layer (a slice of 60 entries over 30 layers, with its unsent updates: 1.06 -> 0.36 ms
    alone, 32 layers, 2K; docs/results/2026-12-07-batch-four-ablations-slice-planning.md)."""
    if not ids.numel():
        return [], 0
    per_layer = entry.length * geometry.layout.num_kv_heads
    layers = ids // per_layer
    breaks = torch.ones(ids.numel(), dtype=torch.bool)
    breaks[1:] = (ids[1:] - ids[:-1] != 1) | (layers[1:] != layers[:-1])  # a run never crosses into the next layer
    firsts = breaks.nonzero().flatten()
    counts = torch.diff(firsts, append=torch.tensor([ids.numel()])).tolist()
    run_layers = layers[firsts]
    starts = (ids[firsts] - run_layers * per_layer).tolist()  # each run's place in its layer: token * H + head
    return _entry_run_ops(geometry, entry, slot, run_layers.tolist(), starts, counts)


def block_entries(length: int, num_blocks: int, plan_blocks: int, blocks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Flat block ids (layer * plan_blocks + block; blocks of `num_blocks` over `length` tokens) -> the flat
    (token, head) entry ids (layer * length + token) * H + head of every head of their tokens, block by block."""
    bounds = block_bounds(length, num_blocks)
    layers, block = blocks // plan_blocks, blocks % plan_blocks
    starts = bounds[block]
    counts = bounds[block + 1] - starts
    firsts = (layers * length + starts).repeat_interleave(counts)  # each token's block's first, flat by layer
    offsets = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
    return (((firsts + offsets) * num_heads)[:, None] + torch.arange(num_heads)).flatten()
