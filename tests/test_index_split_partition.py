"""The index split's counted reorder and flat mask read give what the sort and the 3-D read they replaced gave."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smartgen.engine.index_ops import entry_status, split_reorder_reference
from smartgen.engine.mask import LOCAL, REMOTE


def _sorted_split(index: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, num_heads: int):
    """The definition: mask[slot, token, head] read entry by entry, then a stable descending sort by status."""
    if mask.dim() == 2:
        mask = mask.unsqueeze(-1).expand(-1, -1, num_heads)
    rows, k = index.shape
    status = torch.zeros(rows, k, dtype=torch.int8)
    for r in range(rows):
        for j in range(k):
            token = int(index[r, j])
            if 0 <= token < mask.shape[1]:
                status[r, j] = mask[int(slots[r // num_heads]), token, r % num_heads]
    order = torch.sort(status.to(torch.int16), dim=1, descending=True, stable=True).indices
    return (
        status,
        torch.gather(index, 1, order),
        torch.gather(status, 1, order),
        (status == REMOTE).sum(1, dtype=torch.int32),
        (status == LOCAL).sum(1, dtype=torch.int32),
    )


# pool slots, batch entries and KV heads of a small batch
BATCH = {"num_slots": st.integers(1, 3), "batch": st.integers(1, 3), "num_heads": st.integers(1, 4)}


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    **BATCH,
    num_tokens=st.integers(1, 40),
    k=st.integers(0, 12),
    per_head=st.booleans(),
    strided=st.booleans(),
)
def test_counted_split_equals_the_stable_sort(data, num_slots, batch, num_heads, num_tokens, k, per_head, strided):
    """Any mask of padding, local and remote entries ([S, N, H] or [S, N], contiguous or a strided view), any slots
    and any index with out-of-range entries: the same status, reordered index, status and counts."""
    shape = (num_slots, num_tokens, num_heads) if per_head else (num_slots, num_tokens)
    values = data.draw(st.lists(st.integers(0, 2), min_size=2 * int(torch.tensor(shape).prod()), max_size=None))
    full = torch.tensor(values[: 2 * int(torch.tensor(shape).prod())], dtype=torch.int8).view(*shape[:-1], -1)
    mask = full[..., ::2] if strided else full[..., : shape[-1]].contiguous()
    slots = torch.tensor(data.draw(st.lists(st.integers(0, num_slots - 1), min_size=batch, max_size=batch)))
    tokens = st.integers(-2, num_tokens + 2)
    index = torch.tensor(
        data.draw(
            st.lists(st.lists(tokens, min_size=k, max_size=k), min_size=batch * num_heads, max_size=batch * num_heads)
        ),
        dtype=torch.int64,
    ).view(batch * num_heads, k)
    status, order_index, order_status, num_remote, num_local = _sorted_split(index, mask, slots, num_heads)
    assert torch.equal(entry_status(index, mask, slots, num_heads), status)
    split = split_reorder_reference(index, mask, slots, num_heads)
    assert torch.equal(split.index, order_index)
    assert torch.equal(split.status, order_status)
    assert torch.equal(split.num_remote, num_remote) and split.num_remote.dtype == torch.int32
    assert torch.equal(split.num_local, num_local) and split.num_local.dtype == torch.int32


@settings(max_examples=60, deadline=None)
@given(data=st.data(), **BATCH, num_tokens=st.integers(1, 20), k=st.integers(1, 8), strided_out=st.booleans())
def test_gather_copies_exactly_the_range_of_each_row(data, num_slots, batch, num_heads, num_tokens, k, strided_out):
    """gather_kv_reference writes pool[slot(b), index[r, j], r % H] into out[r, j] for start[r] <= j < stop[r] and
    leaves every other cell as it was, into a contiguous or a strided output."""
    from smartgen.engine.index_ops import gather_kv_reference

    head_dim, rows = 3, batch * num_heads
    k_pool = torch.randn(num_slots, num_tokens, num_heads, head_dim)
    v_pool = torch.randn(num_slots, num_tokens, num_heads, head_dim)
    slots = torch.tensor(data.draw(st.lists(st.integers(0, num_slots - 1), min_size=batch, max_size=batch)))
    index = torch.tensor(
        data.draw(st.lists(st.integers(0, num_tokens - 1), min_size=rows * k, max_size=rows * k)), dtype=torch.int64
    ).view(rows, k)
    bounds = [sorted(data.draw(st.tuples(st.integers(0, k), st.integers(0, k)))) for _ in range(rows)]
    start = torch.tensor([a for a, _ in bounds], dtype=torch.int32)
    stop = torch.tensor([b for _, b in bounds], dtype=torch.int32)
    if strided_out:
        k_out, v_out = (
            torch.full((rows, k, 2 * head_dim), -7.0)[..., ::2],
            torch.full((rows, k, 2 * head_dim), -7.0)[..., ::2],
        )
    else:
        k_out, v_out = torch.full((rows, k, head_dim), -7.0), torch.full((rows, k, head_dim), -7.0)
    expect_k, expect_v = k_out.clone(), v_out.clone()
    for r in range(rows):
        for j in range(int(start[r]), int(stop[r])):
            slot, token, head = int(slots[r // num_heads]), int(index[r, j]), r % num_heads
            expect_k[r, j], expect_v[r, j] = k_pool[slot, token, head], v_pool[slot, token, head]
    gather_kv_reference(k_pool, v_pool, slots, index, start, stop, k_out, v_out)
    assert torch.equal(k_out, expect_k) and torch.equal(v_out, expect_v)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), **BATCH, num_tokens=st.integers(1, 20), k=st.integers(0, 8), strided_out=st.booleans())
def test_gather_valid_copies_each_rows_valid_prefix_and_zeroes_the_rest(
    data, num_slots, batch, num_heads, num_tokens, k, strided_out
):
    """gather_valid_reference gives what zeroed outputs and gather_kv_reference over [0, num_valid) give, whatever
    the padding's positions (-1, past the end, or real tokens), into a contiguous or a strided output."""
    from smartgen.engine.index_ops import gather_kv_reference, gather_valid_reference

    head_dim, rows = 3, batch * num_heads
    k_pool = torch.randn(num_slots, num_tokens, num_heads, head_dim, dtype=torch.float16)
    v_pool = torch.randn(num_slots, num_tokens, num_heads, head_dim, dtype=torch.float16)
    slots = torch.tensor(data.draw(st.lists(st.integers(0, num_slots - 1), min_size=batch, max_size=batch)))
    num_valid = torch.tensor(data.draw(st.lists(st.integers(0, k), min_size=rows, max_size=rows)), dtype=torch.int32)
    valid = torch.tensor(
        data.draw(st.lists(st.integers(0, num_tokens - 1), min_size=rows * k, max_size=rows * k)), dtype=torch.int64
    ).view(rows, k)
    padding = torch.tensor(
        data.draw(st.lists(st.integers(-1, num_tokens + 2), min_size=rows * k, max_size=rows * k)), dtype=torch.int64
    ).view(rows, k)
    index = torch.where(torch.arange(k).unsqueeze(0) < num_valid.unsqueeze(1), valid, padding)
    want_k, want_v = torch.zeros(rows, k, head_dim, dtype=torch.float16), torch.zeros(rows, k, head_dim).half()
    gather_kv_reference(k_pool, v_pool, slots, index, torch.zeros_like(num_valid), num_valid, want_k, want_v)
    if strided_out:
        k_out = torch.full((rows, k, 2 * head_dim), 5.0, dtype=torch.float16)[..., ::2]
        v_out = torch.full((rows, k, 2 * head_dim), 5.0, dtype=torch.float16)[..., ::2]
    else:
        k_out, v_out = torch.empty(rows, k, head_dim, dtype=torch.float16), torch.empty(rows, k, head_dim).half()
    gather_valid_reference(k_pool, v_pool, slots, index, num_valid, k_out, v_out)
    assert torch.equal(k_out, want_k) and torch.equal(v_out, want_v)
