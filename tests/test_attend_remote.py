"""Misses attended where the KV is (`Policy.attend_remote`, scheme `smartgen-attend`): the partial attention and its
merge against attending at once, the ATTEND messages, the policy, and a batch on a slow link whose tokens are the
default scheme's own."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config

from smartgen.engine import messages as msg
from smartgen.engine.attention import merge_partials, partial_attention, sparse_decode_attention
from smartgen.engine.policy import POLICIES, Policy, ProactiveMode, get_policy
from smartgen.runtime.models import model_from_config
from smartgen.runtime.pipeline import InprocPipeline


def _rows(generator: torch.Generator, batch: int, heads: int, group: int, k: int, dim: int):
    query = torch.randn(batch, heads * group, dim, generator=generator)
    keys = torch.randn(batch * heads, k, dim, generator=generator)
    values = torch.randn(batch * heads, k, dim, generator=generator)
    extra = torch.randn(batch * heads, dim, generator=generator), torch.randn(batch * heads, dim, generator=generator)
    return query, keys, values, extra


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_a_remote_part_merged_with_the_local_one_is_attention_over_both(softcap, scale) -> None:
    """Rows' first `cut` entries attended apart (as the prefill node does, per request, over its KV heads), the rest
    with the new token here (the step's local part): merged, the output of attending to every entry at once."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, group, k, dim, cut = 3, 2, 4, 24, 16, 9
    query, keys, values, (extra_k, extra_v) = _rows(generator, batch, heads, group, k, dim)
    valid = torch.tensor([24, 20, 9, 24, 15, 11])  # row 2's entries are all remote
    whole = sparse_decode_attention(query, keys, values, valid, scale, extra_k, extra_v, softcap)
    local, stats = sparse_decode_attention(
        query, keys[:, cut:], values[:, cut:], valid - cut, scale, extra_k, extra_v, softcap, with_stats=True
    )
    assert local.dtype == torch.float32 and stats.shape == (batch, heads * group, 2)
    for b in range(batch):
        rows = range(b * heads, (b + 1) * heads)
        part_k = torch.cat([keys[r, :cut] for r in rows])
        part_v = torch.cat([values[r, :cut] for r in rows])
        head = torch.arange(heads).repeat_interleave(cut)
        remote = partial_attention(query[b], part_k, part_v, head, heads, scale, softcap)
        merged = merge_partials([(local[b], stats[b]), remote])
        assert torch.allclose(merged, whole[b], atol=1e-6)


def test_a_head_with_no_remote_entry_keeps_its_local_attention() -> None:
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(8, 16, generator=generator)
    keys, values = torch.randn(5, 16, generator=generator), torch.randn(5, 16, generator=generator)
    out, stats = partial_attention(query, keys, values, torch.zeros(5, dtype=torch.int64), 2)
    assert torch.isinf(stats[4:, 0]).all() and (stats[4:, 1] == 0).all() and (out[4:] == 0).all()
    local = (torch.randn(8, 16, generator=generator), torch.tensor([[0.5, 2.0]] * 8))
    merged = merge_partials([local, (out, stats)])
    assert torch.allclose(merged[4:], local[0][4:])  # KV head 1's query heads: nothing remote, nothing changes
    with pytest.raises(ValueError, match="groups"):
        partial_attention(query, keys, values, torch.zeros(5, dtype=torch.int64), 3)


def test_attend_messages_round_trip_and_refuse_bad_fields() -> None:
    positions, heads = torch.tensor([3, 9]), torch.tensor([[True, False], [True, True]])
    ask = msg.Attend("r1", 4, 17, positions, heads, torch.randn(8, 16), 0.25, softcap=30.0)
    back = msg.unpack(ask.pack())
    assert isinstance(back, msg.Attend)
    assert (back.layer, back.fetch_id, back.scale, back.softcap) == (4, 17, 0.25, 30.0)
    assert torch.equal(back.positions, positions) and torch.equal(back.heads, heads)
    assert torch.equal(back.query, ask.query)
    reply = msg.AttendReply("r1", 17, torch.randn(8, 16), torch.randn(8, 2))
    assert msg.unpack(reply.pack()).num_bytes == 8 * 16 * 4 + 8 * 2 * 4
    bad_query = ask.pack()
    bad_query.payload["query"] = torch.randn(8, 16, dtype=torch.float16)
    with pytest.raises(msg.MessageError, match="query"):
        msg.unpack(bad_query)
    no_heads = ask.pack()
    del no_heads.payload["heads"]
    with pytest.raises(msg.MessageError, match="heads"):
        msg.unpack(no_heads)
    bad_stats = reply.pack()
    bad_stats.payload["stats"] = torch.randn(8, 3)
    with pytest.raises(msg.MessageError, match="stats"):
        msg.unpack(bad_stats)


def test_the_policy_needs_remote_entries_to_attend_to() -> None:
    assert POLICIES["smartgen-attend"].attend_remote and not POLICIES["smartgen-attend"].prefetch
    assert not POLICIES["smartgen"].attend_remote
    with pytest.raises(ValueError, match="attending"):
        Policy("x", proactive=ProactiveMode.BUDGET, speculative=False, drop_remote=True, attend_remote=True)
    with pytest.raises(ValueError, match="attending"):
        Policy("x", proactive=ProactiveMode.ALL, speculative=False, wait_for_all=True, attend_remote=True)


def _batch(scheme: str) -> tuple[list[list[int]], dict[str, int], list[int]]:
    """Three prompts on a slow link (the later ones join the first's batch), greedy: tokens, the prefill node's
    FETCHes and ATTENDs served, and each request's entries attended."""
    model = model_from_config(tiny_config("llama"))
    policy = get_policy(scheme, "sequential", 0.05)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=generator) for n in (256, 256, 200)]
    served = {"fetch": 0, "attend": 0}
    with InprocPipeline(model, policy, "quest", {"budget": 0.25}, gbps=0.02, prefill_seconds_per_token=1e-5) as p:
        engine = p.prefill_engine
        fetch, attend = engine._serve_fetch, engine._serve_attend

        def fetched(link, message):
            served["fetch"] += 1
            return fetch(link, message)

        def attended(link, message):
            served["attend"] += 1
            return attend(link, message)

        engine._serve_fetch, engine._serve_attend = fetched, attended  # type: ignore[method-assign]
        free = p.decode_engine.pool.num_free
        results = p.generate(prompts, 12)
        assert p.decode_engine.pool.num_free == free  # every slot given back
    return [r.tokens for r in results], served, [r.metrics.step_attended for r in results]


def test_a_batch_attending_to_its_misses_decodes_the_same_tokens() -> None:
    tokens, served, attended = _batch("smartgen-attend")
    expected, _, none = _batch("smartgen")
    assert tokens == expected
    assert served["attend"] > 0 and sum(attended) > 0
    assert sum(none) == 0  # the default scheme fetches its misses
