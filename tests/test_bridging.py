"""On a fast link a speculative push sends short gaps of already-sent tokens again instead of splitting its runs
around them (three descriptors per run); on a slow link it never resends a token."""

import torch

from smartgen.engine.descriptors import block_write_ops, bridge_runs
from smartgen.engine.layout import KVLayout
from smartgen.engine.planning import Planner
from smartgen.engine.pool import DecodePool, PrefillStore
from smartgen.engine.prefill import RUN_COST_S, OpenedRequest, PrefillEngine


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
    unsent[:, 40, 0] = False  # a fetch brought one head of token 40: it is still to send, so not resendable
    return OpenedRequest(
        "r",
        0,
        64,
        None,
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
    assert resendable[:, 20:30].all() and not resendable[:, :20].any() and not resendable[:, 30:].any()
    assert resendable.shape == (layout.num_layers, 64)
    _, resendable = engine._bridge(_opened(engine, layout, 1e12, held_prefix=25))
    assert resendable is not None and not resendable[:, :25].any() and resendable[:, 25:30].all()
    request = _opened(engine, layout, 1e12)
    request.held = torch.zeros(layout.num_layers, 64, dtype=torch.bool)
    request.held[3, 22:24] = True  # KV the decode node kept from a lost prefill node: not this node's bytes
    _, resendable = engine._bridge(request)
    assert resendable is not None and not resendable[3, 22:24].any() and resendable[3, 20:22].all()
