"""No KV byte crosses the link twice where the engine can know better: layers 0-1 are waited for, not fetched, while
their push is on the way; a speculative push never resends a token an on-demand fetch already brought whole; a
fetch moves only the (token, KV head) entries its step selected."""

import torch
from tiny_models import tiny_config

from smartgen.engine.policy import get_policy
from smartgen.runtime.models import model_from_config
from smartgen.runtime.pipeline import InprocPipeline

LENGTH = 256


def _pipeline(scheme: str) -> InprocPipeline:
    model = model_from_config(tiny_config("llama"))
    policy = get_policy(scheme, "sequential", 0.05)
    # a slow link: layer 0-1's push is still on its way when the first decode step starts
    return InprocPipeline(model, policy, "quest", {"budget": 0.25}, gbps=0.02, prefill_seconds_per_token=1e-5)


def _prompt() -> torch.Tensor:
    return torch.randint(3, 97, (LENGTH,), generator=torch.Generator().manual_seed(5))


def test_partial_transfer_moves_no_token_twice():
    with _pipeline("partial") as pipeline:
        pipeline.generate([_prompt()], 12)
        moved = pipeline.prefill_engine.counters.snapshot()["bytes"]
        kv = pipeline.layout.kv_bytes(LENGTH)
    assert moved["proactive"] + moved["on_demand"] <= kv
    assert moved["proactive"] == pipeline.layout.kv_bytes(LENGTH, num_layers=2)  # layers 0-1, once


def test_a_speculative_push_never_resends_a_fetched_token():
    with _pipeline("smartgen-no-head-start") as pipeline:  # the decode node fetches
        engine = pipeline.prefill_engine
        geometry = pipeline.decode_engine.pool.geometry
        heads_of: dict[tuple[int, int], set[int]] = {}
        fetched: set[tuple[int, int]] = set()  # tokens every KV head of which a fetch brought
        resent: list[tuple[int, int]] = []
        serve_fetch, push = engine._serve_fetch, engine._push
        num_heads = pipeline.layout.num_kv_heads

        def record_fetch(link, message):
            heads = message.heads if message.heads is not None else torch.ones(len(message.positions), num_heads)
            for p, row in zip(message.positions.tolist(), heads.bool()):
                got = heads_of.setdefault((message.layer, p), set())
                got.update(row.nonzero().flatten().tolist())
                if len(got) == num_heads:
                    fetched.add((message.layer, p))
            return serve_fetch(link, message)

        def record_push(request, layer_blocks, tag):
            if tag == "speculative":
                post = request.link.push.post_writes

                def check(request_id, sources, ops, tag=None):
                    for op in ops:
                        if op.dst != "k":
                            continue
                        first = op.dst_offset // geometry.layout.token_bytes
                        for flat in range(first, first + op.length // geometry.layout.token_bytes):
                            layer, token = (
                                flat // (geometry.num_slots * geometry.max_tokens),
                                flat % geometry.max_tokens,
                            )
                            if (layer, token) in fetched:
                                resent.append((layer, token))
                    return post(request_id, sources, ops, tag=tag)

                request.link.push.post_writes = check
                try:
                    return push(request, layer_blocks, tag)
                finally:
                    del request.link.push.post_writes
            return push(request, layer_blocks, tag)

        engine._serve_fetch, engine._push = record_fetch, record_push
        pipeline.generate([_prompt()], 16)
        moved = engine.counters.snapshot()["bytes"]
    assert fetched and moved["speculative"] > 0, "the run must both fetch and speculate for this to test anything"
    assert not resent, f"{len(resent)} fetched tokens pushed again, e.g. {resent[:3]}"


def test_a_speculative_slice_holds_what_the_link_moves_between_two_idle_notices():
    """Fetches pre-empt pushes, so a slice still on the link when the next fetch comes is partly sent twice: a
    slice is sized by the measured link rate x the time between idle notices (at least one block, at most the
    speculative ratio's share), and by the ratio alone until a rate is measured; the first notice, with no window
    behind it, sends one block."""
    from smartgen.engine.layout import KVLayout
    from smartgen.engine.prefill.decide import slice_blocks

    token_bytes = KVLayout(4, 2, 8, num_blocks=16).token_bytes
    block_bytes = 2 * 4 * token_bytes  # 4 unsent tokens per block, K and V
    pending = torch.full((10,), 4.0)
    assert slice_blocks(token_bytes, 0.0, 0.001, pending, 6) == 6  # no rate measured yet: the ratio's share
    assert slice_blocks(token_bytes, 1e15, 0.0, pending, 6) == 1  # no window yet: the first step's fetches go first
    assert slice_blocks(token_bytes, 2.5 * block_bytes / 0.001, 0.001, pending, 6) == 2
    assert slice_blocks(token_bytes, 1.0, 0.001, pending, 6) == 1  # never nothing: speculation always moves on
    assert slice_blocks(token_bytes, 1e15, 0.001, pending, 6) == 6
    # fetch replies sent in the window take its link time first: what they leave sizes the slice, and when they
    # took it all, no slice goes (the next notice tries again)
    rate = 4.5 * block_bytes / 0.001
    assert slice_blocks(token_bytes, rate, 0.001, pending, 6, fetched=2 * block_bytes) == 2
    assert slice_blocks(token_bytes, rate, 0.001, pending, 6, fetched=5 * block_bytes) == 0


def test_a_fetch_moves_only_the_selected_heads():
    """Quest picks pages per KV head: a fetch brings each remote (token, head) entry once, not every head of a token
    any head picked, so its bytes are the remote entries' and never more."""
    with _pipeline("partial") as pipeline:
        engine = pipeline.prefill_engine
        layout = pipeline.layout
        entries = tokens = 0
        serve_fetch = engine._serve_fetch

        def record_fetch(link, message):
            nonlocal entries, tokens
            assert message.heads is not None and message.heads.shape == (len(message.positions), layout.num_kv_heads)
            assert bool(message.heads.any(dim=1).all()), "a fetched token must want at least one head"
            entries += int(message.heads.sum())
            tokens += len(message.positions)
            return serve_fetch(link, message)

        engine._serve_fetch = record_fetch
        pipeline.generate([_prompt()], 12)
        on_demand = engine.counters.snapshot()["bytes"]["on_demand"]
    entry_bytes = 2 * layout.head_dim * layout.dtype.itemsize
    assert entries < tokens * layout.num_kv_heads, "the heads' selections should differ somewhere"
    assert on_demand >= entries * entry_bytes  # the payload, plus message headers
    assert on_demand < tokens * layout.num_kv_heads * entry_bytes
