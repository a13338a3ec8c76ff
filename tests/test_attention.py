"""Sparse decode attention over assembled rows equals dense attention restricted to the same entries."""

import torch

from smartgen.engine.attention import sparse_decode_attention


def test_matches_dense_attention_on_the_selected_entries_in_any_order():
    torch.manual_seed(0)
    batch, kv_heads, group, n, d, k = 2, 3, 2, 50, 16, 11
    keys = torch.randn(batch, kv_heads, n, d)
    values = torch.randn(batch, kv_heads, n, d)
    query = torch.randn(batch, kv_heads * group, d)
    index = torch.stack([torch.randperm(n)[:k] for _ in range(batch * kv_heads)])  # [R, k]
    num_valid = torch.tensor([k, 5, 1, k, 0, 7])
    rows_k = torch.stack([keys[r // kv_heads, r % kv_heads, index[r]] for r in range(batch * kv_heads)])
    rows_v = torch.stack([values[r // kv_heads, r % kv_heads, index[r]] for r in range(batch * kv_heads)])
    out = sparse_decode_attention(query, rows_k, rows_v, num_valid)
    for b in range(batch):
        for qh in range(kv_heads * group):
            r = b * kv_heads + qh // group
            m = int(num_valid[r])
            if m == 0:
                assert torch.equal(out[b, qh], torch.zeros(d))
                continue
            sel = index[r, :m]
            w = torch.softmax(query[b, qh] @ keys[b, qh // group, sel].T / d**0.5, -1)
            torch.testing.assert_close(out[b, qh], w @ values[b, qh // group, sel])
    # reordering the valid entries of a row changes nothing
    perm = torch.cat([torch.randperm(k)])
    out2 = sparse_decode_attention(query, rows_k[:, perm], rows_v[:, perm], torch.full((6,), k))
    out1 = sparse_decode_attention(query, rows_k, rows_v, torch.full((6,), k))
    torch.testing.assert_close(out1, out2)
