"""Properties of the split/reorder/gather reference operators (the CPU path)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smartgen.engine.index_ops import (
    gather_kv_reference,
    split_all_local,
    split_reorder_cpu,
    split_reorder_reference,
)
from smartgen.engine.mask import LOCAL, PAD, REMOTE


@st.composite
def index_and_mask(draw):
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 4))
    num_slots = batch + draw(st.integers(0, 2))
    num_tokens = draw(st.integers(1, 40))
    k = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, num_tokens + 1, (num_slots,), generator=g)
    mask = torch.zeros(num_slots, num_tokens, dtype=torch.int8)
    for s in range(num_slots):
        mask[s, : lengths[s]] = torch.randint(1, 3, (int(lengths[s]),), generator=g).to(torch.int8)
    slots = torch.randperm(num_slots, generator=g)[:batch]
    index = torch.randint(-2, num_tokens + 2, (batch * heads, k), generator=g)
    return index, mask, slots, heads


@settings(max_examples=200, deadline=None)
@given(index_and_mask())
def test_local_and_remote_partition_the_valid_index(case):
    index, mask, slots, heads = case
    split = split_reorder_reference(index, mask, slots, heads)
    for r in range(index.shape[0]):
        slot = int(slots[r // heads])
        row = index[r].tolist()
        valid = [p for p in row if 0 <= p < mask.shape[1] and mask[slot, p] != PAD]
        nr, nl = int(split.num_remote[r]), int(split.num_local[r])
        remote = split.index[r, :nr].tolist()
        local = split.index[r, nr : nr + nl].tolist()
        assert sorted(remote + local) == sorted(valid)  # union is the valid index
        assert all(mask[slot, p] == REMOTE for p in remote)
        assert all(mask[slot, p] == LOCAL for p in local)  # so remote ∩ local = ∅
        # selection order is kept inside each lane (stable reorder)
        assert remote == [p for p in row if p in valid and mask[slot, p] == REMOTE]


@settings(max_examples=200, deadline=None)
@given(index_and_mask())
def test_padding_is_never_selected_and_remote_comes_first(case):
    index, mask, slots, heads = case
    split = split_reorder_reference(index, mask, slots, heads)
    status = split.status.long()
    # every row is non-increasing: remote (2), then local (1), then padding (0)
    assert bool((status[:, 1:] <= status[:, :-1]).all())
    valid = split.num_remote + split.num_local
    for r in range(index.shape[0]):
        assert bool((status[r, int(valid[r]) :] == PAD).all())
        assert bool((status[r, : int(valid[r])] != PAD).all())


@settings(max_examples=100, deadline=None)
@given(index_and_mask(), st.integers(1, 9))
def test_gather_fills_exactly_the_window(case, head_dim):
    index, mask, slots, heads = case
    split = split_reorder_reference(index, mask, slots, heads)
    num_slots, num_tokens = mask.shape
    k_pool = torch.randn(num_slots, num_tokens, heads, head_dim)
    v_pool = torch.randn(num_slots, num_tokens, heads, head_dim)
    rows, k = index.shape
    k_out = torch.full((rows, k, head_dim), 7.0)
    v_out = torch.full((rows, k, head_dim), 7.0)
    start, stop = split.num_remote, split.num_remote + split.num_local
    gather_kv_reference(k_pool, v_pool, slots, split.index, start, stop, k_out, v_out)
    for r in range(rows):
        slot, head = int(slots[r // heads]), r % heads
        for j in range(k):
            if int(start[r]) <= j < int(stop[r]):
                p = int(split.index[r, j])
                assert torch.equal(k_out[r, j], k_pool[slot, p, head])
                assert torch.equal(v_out[r, j], v_pool[slot, p, head])
            else:
                assert bool((k_out[r, j] == 7.0).all())


def test_split_rejects_a_badly_shaped_index():
    import pytest

    with pytest.raises(ValueError, match=r"\[B\*H, k\]"):
        split_reorder_reference(
            torch.zeros(5, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int8), torch.tensor([0, 1]), 2
        )


@settings(max_examples=200, deadline=None)
@given(index_and_mask(), st.booleans())
def test_an_all_local_split_read_without_the_mask_is_the_general_one(case, trailing_padding):
    """Where each request holds [0, length) local and nothing past it, `split_all_local` (lengths only) equals the
    general split field for field: index order, status, counts; with padding only at row ends (a selector's rows)
    and with padding anywhere (the stable partition)."""
    index, mask, slots, heads = case
    lengths = (mask != PAD).sum(1)  # the drawn masks are a run of non-padding from 0
    mask = torch.where(mask != PAD, torch.full_like(mask, LOCAL), mask)
    if trailing_padding:  # in-range entries first in each row, then padding, as pad_rows leaves them
        row_length = lengths[slots].repeat_interleave(heads).unsqueeze(1)
        valid = (index >= 0) & (index < row_length)
        order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices
        index = torch.gather(index, 1, order)
    want = split_reorder_reference(index, mask, slots, heads)
    got = split_all_local(index, lengths[slots].repeat_interleave(heads))
    for field in ("index", "status", "num_remote", "num_local"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert getattr(got, field).dtype == getattr(want, field).dtype, field


@settings(max_examples=200, deadline=None)
@given(index_and_mask(), st.booleans(), st.booleans())
def test_the_cpu_split_is_the_reference_whether_or_not_a_pick_is_remote(case, picks_local, trailing_padding):
    """`split_reorder_cpu` equals the reference field for field: with remote picks (the partition), and where the
    layer holds remote tokens but no pick is one (its fast path: order kept, or partitioned where padding comes
    first)."""
    index, mask, slots, heads = case
    if picks_local:  # every in-range pick local, other tokens of the slots left as drawn (some remote)
        num_tokens = mask.shape[1]
        row_slot = slots.repeat_interleave(heads)
        for r in range(index.shape[0]):
            for position in index[r].tolist():
                if 0 <= position < num_tokens and mask[row_slot[r], position] == REMOTE:
                    mask[row_slot[r], position] = LOCAL
    if trailing_padding:  # non-padding first in each row, as pad_rows leaves a selector's rows
        in_range = (index >= 0) & (index < mask.shape[1])
        order = torch.sort((~in_range).to(torch.uint8), dim=1, stable=True).indices
        index = torch.gather(index, 1, order)
    want = split_reorder_reference(index, mask, slots, heads)
    got = split_reorder_cpu(index, mask, slots, heads)
    for field in ("index", "status", "num_remote", "num_local"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert getattr(got, field).dtype == getattr(want, field).dtype, field
