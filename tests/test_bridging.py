"""On a fast link a speculative push sends short gaps of already-sent tokens again instead of splitting its runs
around them (three descriptors per run); on a slow link it never resends a token."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smartgen.engine.descriptors import (
    _entry_write_ops,
    _layer_write_ops,
    block_entries,
    block_wants,
    block_write_ops,
    bridge_runs,
    entry_write_ops,
    token_write_ops,
)
from smartgen.engine.layout import KVLayout, block_bounds
from smartgen.engine.planning import Planner
from smartgen.engine.policy import get_policy
from smartgen.engine.pool import DecodePool, PrefillStore
from smartgen.engine.prefill import RUN_COST_S, OpenedRequest, PrefillEngine
from smartgen.engine.prefill.decide import entry_wants
from smartgen.lanes.base import Completion


def test_bridge_runs_merges_only_short_resendable_gaps():
    runs = [(0, 4), (6, 10), (20, 22), (23, 30)]
    every = torch.ones(40, dtype=torch.bool)
    assert bridge_runs(runs, 0, every) == runs
    assert bridge_runs(runs, 2, every) == [(0, 10), (20, 30)]
    assert bridge_runs(runs, 10, every) == [(0, 30)]
    some = every.clone()
    some[5] = False  # a token the decode node holds from elsewhere is never rewritten
    assert bridge_runs(runs, 10, some) == [(0, 4), (6, 30)]
    assert bridge_runs([(3, 9)], 10, every) == [(3, 9)]


def test_a_bridged_push_writes_the_gap_again_and_fewer_descriptors():
    layout = KVLayout(4, 2, 8, num_blocks=16)
    pool = DecodePool(layout, num_slots=2, max_tokens=128)
    entry = PrefillStore(layout).open("r", 100)
    unsent = torch.ones(4, 100, dtype=torch.bool)
    unsent[2, 10:12] = False  # fetched: two short gaps and a long one
    unsent[2, 40:41] = False
    unsent[2, 60:80] = False
    blocks = [(2, torch.arange(16))]
    ops, kv_bytes = block_write_ops(pool.geometry, entry, 1, blocks, unsent)
    assert len(ops) == 3 * 4 and kv_bytes == 2 * 77 * layout.token_bytes
    ops, kv_bytes = block_write_ops(pool.geometry, entry, 1, blocks, unsent, 4, ~unsent)
    masks = [op for op in ops if op.dst == "mask"]
    first = pool.geometry.mask_offset(2, 1, 0)
    heads = layout.num_kv_heads  # one mask byte per token and KV head
    assert [(op.dst_offset - first, op.length) for op in masks] == [(0, 60 * heads), (80 * heads, 20 * heads)]
    assert kv_bytes == 2 * 80 * layout.token_bytes and len(ops) == 3 * 2
    kinds = [op.dst == "mask" for op in ops]
    assert kinds == sorted(kinds)  # data before mask still


def _opened(engine: PrefillEngine, layout: KVLayout, rate: float, held_prefix: int = 0) -> OpenedRequest:
    entry = PrefillStore(layout).open("r", 64)
    unsent = torch.ones(layout.num_layers, 64, layout.num_kv_heads, dtype=torch.bool)  # per (token, KV head)
    unsent[:, 20:30] = False
    unsent[:, 40, 0] = False  # a fetch brought one head of token 40: that head may be resent, the other is unsent
    return OpenedRequest(
        "r",
        0,
        64,
        get_policy("smartgen"),
        None,
        None,
        None,
        entry,
        torch.ones(1, dtype=torch.int8),  # type: ignore[arg-type]
        held_prefix=held_prefix,
        unsent=unsent,
        link_rate=rate,
    )


def test_the_gap_worth_resending_follows_the_measured_link_rate():
    layout = KVLayout(4, 2, 8, num_blocks=16)
    engine = PrefillEngine(layout, Planner(4, 16))
    token = 2 * layout.token_bytes  # K and V
    assert engine._bridge(_opened(engine, layout, 0.0)) == (0, None)  # no rate measured yet
    assert engine._bridge(_opened(engine, layout, token / RUN_COST_S * 0.5)) == (0, None)  # slow: bytes cost more
    tokens, resendable = engine._bridge(_opened(engine, layout, token / RUN_COST_S * 8.5))
    assert tokens == 8 and resendable is not None
    assert resendable[:, 20:30].all() and not resendable[:, :20].any() and not resendable[:, 30:40].any()
    assert resendable[:, 40, 0].all() and not resendable[:, 40, 1:].any() and not resendable[:, 41:].any()
    assert resendable.shape == (layout.num_layers, 64, layout.num_kv_heads)  # per entry, as pushes are
    _, resendable = engine._bridge(_opened(engine, layout, 1e12, held_prefix=25))
    assert resendable is not None and not resendable[:, :25].any() and resendable[:, 25:30].all()
    request = _opened(engine, layout, 1e12)
    request.held = torch.zeros(layout.num_layers, 64, dtype=torch.bool)
    request.held[3, 22:24] = True  # KV the decode node kept from a lost prefill node: not this node's bytes
    _, resendable = engine._bridge(request)
    assert resendable is not None and not resendable[3, 22:24].any() and resendable[3, 20:22].all()


def _apply(ops, sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
    for op in ops:
        dst, src = targets[op.dst], sources[op.src]
        dst[op.dst_offset : op.dst_offset + op.length].copy_(src[op.src_offset : op.src_offset + op.length])


def test_a_push_sends_only_the_heads_no_fetch_sent():
    """Per-head `unsent`: a token one of whose heads a fetch brought is pushed without that head, and the pool ends
    with every entry right and every mask byte set."""
    layout = KVLayout(4, 2, 8, num_blocks=16)
    pool = DecodePool(layout, num_slots=2, max_tokens=128)
    entry = PrefillStore(layout).open("r", 100)
    entry.k.copy_(torch.randn_like(entry.k))
    entry.v.copy_(torch.randn_like(entry.v))
    unsent = torch.ones(4, 100, 2, dtype=torch.bool)
    unsent[2, 10:20, 0] = False  # a fetch brought head 0 of tokens 10-19
    unsent[2, 50, :] = False  # and both heads of token 50
    ops, kv_bytes = block_write_ops(pool.geometry, entry, 1, [(2, torch.arange(16))], unsent)
    head_bytes = layout.token_bytes // 2
    assert kv_bytes == 2 * (200 - 10 - 2) * head_bytes  # 100 tokens x 2 heads, less what the fetches sent
    # entries 0..20 (tokens 0-9 both heads, token 10 head 0 is sent) then head 1 of 10-19 one at a time, ...
    masks = [(op.dst_offset - pool.geometry.mask_offset(2, 1, 0), op.length) for op in ops if op.dst == "mask"]
    assert masks[0] == (0, 20) and masks[1:10] == [(2 * t + 1, 1) for t in range(10, 19)]
    assert masks[10] == (39, 61) and masks[11] == (102, 98)  # head 1 of 19 through token 49, then 51 onwards
    fetched = ~unsent[2]  # what the fetches had landed already
    pool.k[2, 1, :100][fetched] = entry.k[2][fetched]
    pool.v[2, 1, :100][fetched] = entry.v[2][fetched]
    pool.masks.values[2, 1, :100][fetched] = 1
    _apply(ops, {**entry.byte_views(), "ones": torch.ones(400, dtype=torch.int8).view(torch.uint8)}, pool.byte_views())
    assert torch.equal(pool.k[2, 1, :100], entry.k[2]) and torch.equal(pool.v[2, 1, :100], entry.v[2])
    assert bool((pool.masks.values[2, 1, :100] == 1).all()) and not bool(pool.masks.values[2, 1, 100:].any())
    assert not bool(pool.masks.values[3].any())  # other layers untouched
    # a whole token's unsent heads are adjacent: with nothing fetched it is the same three descriptors as per token
    ops, kv_bytes = block_write_ops(pool.geometry, entry, 1, [(3, torch.arange(16))], torch.ones(4, 100, 2).bool())
    assert len(ops) == 3 and kv_bytes == 2 * 100 * layout.token_bytes


@given(st.integers(0, 2**31), st.integers(2, 6), st.booleans(), st.floats(0.0, 1.0))
@settings(max_examples=60, deadline=None)
def test_all_layers_at_once_make_the_descriptors_a_layer_at_a_time_does(seed, num_wanted, by_entry, fetched):
    """A hinted slice's descriptors found for every layer at once (`_entry_write_ops`) are those the per-layer walk
    makes, in the same order: per (token, head) entry wants and whole-token ones, over a per-head unsent mask."""
    layout = KVLayout(6, 3, 8, num_blocks=16)
    pool = DecodePool(layout, num_slots=2, max_tokens=64)
    entry = PrefillStore(layout).open("r", 50)
    rng = torch.Generator().manual_seed(seed)
    unsent = torch.rand(6, 50, 3, generator=rng) >= fetched
    layers = torch.randperm(6, generator=rng)[:num_wanted].tolist()
    shape = (50, 3) if by_entry else (50,)
    wants = [(layer, torch.rand(*shape, generator=rng) < 0.4) for layer in layers]
    ops, kv_bytes = _entry_write_ops(pool.geometry, entry, 1, wants, unsent)
    assert (ops, kv_bytes) == _layer_write_ops(pool.geometry, entry, 1, wants, unsent, 0, None)
    assert token_write_ops(pool.geometry, entry, 1, wants, unsent) == (ops, kv_bytes)


@given(st.integers(0, 2**31), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
@settings(max_examples=80, deadline=None)
def test_descriptors_from_entry_ids_are_those_of_the_per_layer_walk(seed, density, fetched):
    """A hinted slice's descriptors made from its flat (token, head) ids alone (`entry_write_ops`) are those the
    per-layer walk makes from the same entries as [n, H] wants over the per-head unsent mask, in the same order: runs
    that end at a layer's last entry never run on into the next layer's first, though their ids are consecutive."""
    layout = KVLayout(5, 3, 8, num_blocks=16)
    pool = DecodePool(layout, num_slots=3, max_tokens=64)
    entry = PrefillStore(layout).open("r", 40)
    rng = torch.Generator().manual_seed(seed)
    unsent = torch.rand(5, 40, 3, generator=rng) >= fetched
    wanted = (torch.rand(5, 40, 3, generator=rng) < density) & unsent
    wanted[1, -1, -1] = wanted[2, 0, 0] = bool(unsent[1, -1, -1] and unsent[2, 0, 0])  # ids adjacent across layers
    ids = wanted.flatten().nonzero().flatten()
    wants = entry_wants(ids, 5, 40, 3)
    assert entry_write_ops(pool.geometry, entry, 2, ids) == _layer_write_ops(
        pool.geometry, entry, 2, wants, unsent, 0, None
    )


def test_a_hinted_push_sends_its_entries_once_and_marks_them_sent():
    """`_push_entries` posts the descriptors of the distinct unsent entries it is handed (repeats and any order) and
    marks exactly those sent; the pool then holds them byte for byte, masks set, nothing else."""
    layout = KVLayout(4, 2, 8, num_blocks=16)
    engine = PrefillEngine(layout, Planner(4, 16))
    pool = DecodePool(layout, num_slots=2, max_tokens=64)
    entry = PrefillStore(layout).open("r", 50)
    entry.k.copy_(torch.randn_like(entry.k))
    entry.v.copy_(torch.randn_like(entry.v))
    entry.layers_ready = layout.num_layers
    unsent = torch.ones(4, 50, 2, dtype=torch.bool)
    posted: list = []

    class Lane:
        def post_writes(self, request_id, sources, ops, *, tag):
            posted.append((sources, list(ops)))
            return Completion()

    class Link:
        push = Lane()

    ones = torch.ones(400, dtype=torch.int8)
    request = OpenedRequest("r", 1, 50, get_policy("smartgen"), None, Link(), pool.geometry, entry, ones, unsent=unsent)  # type: ignore[arg-type]
    ids = torch.tensor(
        [(3 * 50 + 7) * 2 + 1, (1 * 50 + 2) * 2, (3 * 50 + 7) * 2 + 1, (1 * 50 + 3) * 2, (1 * 50 + 2) * 2 + 1]
    )
    sent = engine._push_entries(request, ids)
    assert sent == 2 * 4 * (layout.token_bytes // 2)  # four distinct entries, K and V
    expected = torch.zeros(4, 50, 2, dtype=torch.bool)
    expected[3, 7, 1] = expected[1, 2, 0] = expected[1, 2, 1] = expected[1, 3, 0] = True
    assert torch.equal(~unsent, expected)
    sources, ops = posted[0]
    _apply(ops, {**sources, "ones": sources["ones"].view(torch.uint8)}, pool.byte_views())
    assert torch.equal(pool.k[:, 1, :50][expected], entry.k[expected])
    assert torch.equal(pool.v[:, 1, :50][expected], entry.v[expected])
    assert torch.equal(pool.masks.values[:, 1, :50] == 1, expected) and not bool(pool.masks.values[:, 0].any())


@given(st.integers(0, 2**31), st.integers(5, 90), st.integers(1, 40), st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_block_entries_are_every_head_of_the_blocks_tokens(seed, length, num_blocks, heads):
    """`block_entries` names exactly the (token, head) entries, every head, of the tokens `block_wants` gives for the
    same blocks, blocks of any size (a block of one token or of several, the plan's block count above the prompt's)."""
    rng = torch.Generator().manual_seed(seed)
    layout = KVLayout(3, heads, 8, num_blocks=num_blocks)
    pool = DecodePool(layout, num_slots=1, max_tokens=96)
    m_eff = int(block_bounds(length, num_blocks).numel()) - 1
    plan_blocks = m_eff + int(torch.randint(0, 3, (1,), generator=rng))
    chosen = torch.randperm(3 * m_eff, generator=rng)[: int(torch.randint(1, 3 * m_eff + 1, (1,), generator=rng))]
    flat = chosen // m_eff * plan_blocks + chosen % m_eff  # layer * plan_blocks + block, in any order
    layer_blocks = [(layer, flat[flat // plan_blocks == layer] % plan_blocks) for layer in range(3)]
    expected = torch.zeros(3, length, heads, dtype=torch.bool)
    for layer, want in block_wants(length, pool.geometry, layer_blocks):
        expected[layer, want] = True
    entries = block_entries(length, num_blocks, plan_blocks, flat, heads)
    named = torch.zeros(3 * length * heads, dtype=torch.bool)
    named[entries] = True
    assert entries.numel() == int(expected.sum())  # each once
    assert torch.equal(named.view(3, length, heads), expected)


def test_a_speculative_slice_by_entries_posts_what_the_per_layer_walk_does():
    """A slice of the plan's order pushed by its entries (`_push_entries` of `block_entries`) posts the descriptors,
    marks the entries sent and counts the held prefix as the per-layer walk (`_push`) does."""
    layout = KVLayout(4, 2, 8, num_blocks=16)
    pool = DecodePool(layout, num_slots=2, max_tokens=64)
    store = PrefillStore(layout)

    class Lane:
        def __init__(self) -> None:
            self.posted: list = []

        def post_writes(self, request_id, sources, ops, *, tag):
            self.posted.append(list(ops))
            return Completion()

    class Link:
        def __init__(self) -> None:
            self.push = Lane()

    results = []
    blocks = torch.tensor([2 * 16 + 5, 0 * 16 + 1, 2 * 16 + 4, 3 * 16 + 15, 0 * 16 + 0])
    for by_entries in (False, True):
        engine = PrefillEngine(layout, Planner(4, 16))
        entry = store.open(f"r{by_entries}", 50)
        unsent = torch.ones(4, 50, 2, dtype=torch.bool)
        unsent[:, :4] = False  # the decode node's own prefix
        unsent[2, 15, 1] = unsent[3, 48, 0] = False  # fetched
        link = Link()
        request = OpenedRequest(
            f"r{by_entries}",
            1,
            50,
            get_policy("smartgen"),
            None,
            link,
            pool.geometry,
            entry,
            torch.ones(400, dtype=torch.int8),
            unsent=unsent,
            held_prefix=4,
        )  # type: ignore[arg-type]
        if by_entries:
            sent = engine._push_entries(request, block_entries(50, 16, 16, blocks, 2))
        else:
            layer_blocks = [(layer, blocks[blocks // 16 == layer] % 16) for layer in range(4)]
            sent = engine._push(request, [(layer, b) for layer, b in layer_blocks if b.numel()], "speculative")
        results.append((sent, link.push.posted, unsent.clone(), engine.held_saved.snapshot()))
    assert results[0][0] == results[1][0] > 0
    assert results[0][1] == results[1][1]
    assert torch.equal(results[0][2], results[1][2])
    assert results[0][3] == results[1][3]
