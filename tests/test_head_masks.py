"""Masks per (token, KV head): fetched entries land alone, a token is local only when every head is."""

import torch

from smartgen.engine.layout import KVLayout
from smartgen.engine.mask import LOCAL, PAD, REMOTE, MaskTable
from smartgen.engine.messages import Fetch, MessageError
from smartgen.engine.pool import DecodePool
from smartgen.lanes.base import Message


def test_a_fetched_entry_lands_alone_and_its_token_stays_remote():
    layout = KVLayout(3, 2, 4, num_blocks=4)
    pool = DecodePool(layout, num_slots=2, max_tokens=16)
    slot = pool.allocate(10)
    k = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)
    entries = torch.tensor([2 * 2 + 1, 5 * 2 + 0, 5 * 2 + 1])  # (token 2, head 1), token 5 both heads
    pool.write_entries(1, slot, entries, k, -k)
    assert torch.equal(pool.k[1, slot, 2, 1], k[0]) and torch.equal(pool.v[1, slot, 5, 0], -k[1])
    assert bool(pool.k[1, slot, 2, 0].eq(0).all())  # the head nobody asked for is untouched
    mask = pool.masks.layer(1)[slot]
    assert mask[2].tolist() == [REMOTE, LOCAL] and mask[5].tolist() == [LOCAL, LOCAL]
    assert pool.masks.summary(1, slot) == (16 - 10, 1, 9)  # token 2 is half local: it counts as remote
    states = pool.masks.token_states(slot, 10)
    assert states.shape == (3, 10) and states[1, 5] == LOCAL and states[1, 2] == REMOTE and states[0, 5] == REMOTE
    assert pool.masks.tokens_local(1, slot, 0, 10).nonzero().flatten().tolist() == [5]


def test_a_token_is_local_only_when_every_head_is():
    table = MaskTable(2, 1, 6, num_heads=3)
    table.open(0, 4)
    table.set_local(0, 0, 0, 4)
    table.set_local(1, 0, 0, 2)
    assert table.local_prefix(0, 4) == 2 and not table.all_local(0, 4)
    table.set_local_entries(1, 0, torch.tensor([2 * 3 + 0, 2 * 3 + 1]))  # token 2: two of its three heads
    assert table.local_prefix(0, 4) == 2
    table.set_local_entries(1, 0, torch.tensor([2 * 3 + 2]))
    assert table.local_prefix(0, 4) == 3
    table.append_local(0, 4)
    assert table.values[:, 0, 4].eq(LOCAL).all() and table.values[:, 0, 5].eq(PAD).all()


def test_fetch_carries_its_heads_and_refuses_a_bad_shape():
    heads = torch.tensor([[True, False], [True, True]])
    fetch = Fetch("r", 3, 7, torch.tensor([4, 9]), heads)
    back = Fetch.unpack(fetch.pack())
    assert back.heads is not None and torch.equal(back.heads, heads) and back.positions.tolist() == [4, 9]
    assert Fetch.unpack(Fetch("r", 3, 7, torch.tensor([4])).pack()).heads is None  # every head
    bad = fetch.pack()
    bad = Message(bad.kind, bad.request_id, bad.meta, {**bad.payload, "heads": torch.ones(3, 2, dtype=torch.uint8)})
    try:
        Fetch.unpack(bad)
    except MessageError as exc:
        assert "heads" in str(exc)
    else:
        raise AssertionError("a FETCH whose heads do not match its positions must be refused")
