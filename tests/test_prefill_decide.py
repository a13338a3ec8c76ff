"""The prefill side's decisions, as pure functions: no lane, thread, store or model."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smartgen.engine.layout import effective_blocks
from smartgen.engine.planning import TransferPlan
from smartgen.engine.policy import POLICIES, ProactiveMode, get_policy
from smartgen.engine.prefill import decide
from smartgen.engine.prefill.decide import PrefillFlags, SpeculativeSlice

QUERY = PrefillFlags(query_pick=True)


@pytest.mark.parametrize("name", list(POLICIES))
def test_flags_read_every_policy_once(name):
    policy, flags = POLICIES[name], PrefillFlags.of(POLICIES[name])
    assert (flags.speculative, flags.chain, flags.drop_remote) == (policy.speculative, policy.chain, policy.drop_remote)
    assert flags.full == (policy.proactive == ProactiveMode.ALL)
    assert flags.quantized == bool(policy.quantize_bits)
    assert flags.speculative_ratio == policy.speculative_ratio
    assert flags.replan_on_prefix == (policy.proactive == ProactiveMode.BUDGET and not policy.drop_remote)
    assert PrefillFlags.of(get_policy("smartgen", "query")).query_pick
    assert not PrefillFlags.of(get_policy("smartgen", "optimal")).replan_on_prefix  # its counts are used up


@pytest.mark.parametrize(
    "bad",
    [
        {"speculative_ratio": 0.0},
        {"chain": True},
        {"quantized": True},  # only full transfer is quantized
        {"drop_remote": True, "speculative": True},
    ],
)
def test_flags_refuse_what_no_policy_can_be(bad):
    with pytest.raises(ValueError):
        PrefillFlags(**bad)


def test_a_layer_pushes_its_planned_blocks_or_under_query_the_best_scored():
    planned = torch.tensor([0, 1])
    scores = torch.zeros(40)
    scores[35], scores[12] = 5.0, 3.0  # 40 tokens in 8 blocks of 5: blocks 7 and 2
    assert decide.proactive_blocks(PrefillFlags(), planned, 3, 40, 8, token_scores=scores).tolist() == [0, 1]
    assert decide.proactive_blocks(QUERY, planned, 3, 40, 8).tolist() == [0, 1]  # no scores: the plan's
    assert decide.proactive_blocks(QUERY, planned, 1, 40, 8, token_scores=scores).tolist() == [0, 1]  # dense layer
    assert decide.proactive_blocks(QUERY, planned, 3, 40, 8, token_scores=scores).tolist() == [2, 7]
    held = decide.proactive_blocks(QUERY, planned, 3, 40, 8, token_scores=scores, held_prefix=5)
    assert held.tolist() == [0, 7] and scores[0] == 0  # the held block first; the caller's scores untouched
    assert decide.query_blocks(scores, 40, 8, 0).tolist() == []


def test_a_full_transfer_pushes_on_the_full_path():
    assert decide.push_path(PrefillFlags(full=True), "proactive") == "full"
    assert decide.push_path(PrefillFlags(full=True), "speculative") == "speculative"
    assert decide.push_path(PrefillFlags(), "proactive") == "proactive"


def test_unsent_entries_leave_out_what_the_decode_node_holds():
    held = torch.zeros(2, 6, dtype=torch.bool)
    held[1, 4] = True
    unsent = decide.unsent_entries(2, 6, 3, held, held_prefix=2)
    assert unsent.shape == (2, 6, 3)
    assert not unsent[:, :2].any() and not unsent[1, 4].any()
    assert int(unsent.sum()) == (2 * 4 - 1) * 3
    assert decide.unsent_entries(1, 3, 1, None, 0).all()


def test_the_speculative_order_puts_replaced_proactive_blocks_first_and_skips_what_went():
    proactive = torch.tensor([[True, True, False], [False, True, False]])
    plan = TransferPlan(2, 3, proactive, torch.tensor([5, 2, 3]))
    assert decide.speculative_order(plan, None).tolist() == [5, 2, 3]
    sent = torch.tensor([[True, False, True], [False, True, False]])  # a query pick sent block 2, not block 1
    assert decide.speculative_order(plan, sent).tolist() == [1, 5, 3]


@settings(max_examples=80, deadline=None)
@given(
    rate=st.sampled_from([0.0, 1.0, 1e4, 1e6, 1e12]),
    window=st.sampled_from([0.0, 1e-4, 1e-3, 1e-2]),
    fetched=st.integers(0, 10**5),
    pending=st.lists(st.integers(0, 8), max_size=12),
    limit=st.integers(1, 10),
)
def test_a_slice_is_at_most_the_ratio_and_nothing_only_when_fetches_took_the_window(
    rate, window, fetched, pending, limit
):
    count = decide.slice_blocks(16, rate, window, torch.tensor(pending, dtype=torch.float), limit, fetched)
    assert 0 <= count <= max(limit, 1)
    if count == 0:
        assert fetched and window > 0 and rate > 0 and rate * window <= fetched
    if window <= 0:
        assert count == 1


def test_the_next_slice_passes_over_blocks_fetches_brought_and_waits_when_fetches_took_the_link():
    ahead = torch.tensor([4, 0, 7, 3, 1])
    untracked = decide.next_slice(
        ahead, size=2, num_blocks=4, pending=None, link_rate=0.0, window=0.0, fetched=0, token_bytes=16
    )
    assert untracked.ids.tolist() == [4, 0] and untracked.advance == 2
    pending = torch.tensor([2.0, 0, 0, 1, 0, 0, 0, 3])  # blocks 1, 2, 4, 5, 6 went whole already
    kwargs = {"size": 2, "num_blocks": 4, "pending": pending, "token_bytes": 16}
    no_rate = decide.next_slice(ahead, link_rate=0.0, window=0.01, fetched=0, **kwargs)
    assert no_rate.ids.tolist() == [0, 7] and no_rate.advance == 3  # block 4 passed over, within the cursor
    assert no_rate.layer_blocks() == [(0, torch.tensor([0])), (1, torch.tensor([3]))]
    first = decide.next_slice(ahead, link_rate=1e12, window=0.0, fetched=0, **kwargs)
    assert first.ids.tolist() == [0]  # no window yet: one block, the first step's fetches go first
    assert decide.next_slice(ahead, link_rate=1e3, window=0.01, fetched=100, **kwargs) is None
    done = decide.next_slice(torch.tensor([1, 2]), link_rate=1e3, window=0.01, fetched=0, **kwargs)
    assert done.ids.numel() == 0 and done.advance == 2  # all sent: the cursor runs to the end
    pending_of = decide.pending_tokens(torch.ones(2, 10, 2, dtype=torch.bool), 10, 4, 4)
    assert pending_of.tolist() == [2.0, 3.0, 2.0, 3.0] * 2


def test_a_slice_checks_itself():
    with pytest.raises(ValueError):
        SpeculativeSlice(torch.tensor([1, 2]), 1, 4)  # the cursor passes every block it pushes
    with pytest.raises(ValueError):
        SpeculativeSlice(torch.tensor([[1]]), 1, 4)


def test_hinted_entries_fill_the_idle_window_newest_notice_first():
    entry = 2 * 16
    assert decide.hint_room(16, 0.0, 0.01, 0) is None  # no rate yet: the newest notice, whole
    assert decide.hint_room(16, 10 * entry / decide.CHAIN_WINDOW_S, 0.0, 0) == 10  # no window yet: a chained slice
    assert decide.hint_room(16, 3 * entry / 0.01, 0.01, 0) == 3
    assert decide.hint_room(16, 3 * entry / 0.01, 0.01, 2 * entry) == 1  # fetches took two entries' worth
    assert decide.hint_room(16, 3 * entry / 0.01, 0.01, 3 * entry) == 0  # and here all of it
    unsent = torch.ones(20, dtype=torch.bool)
    unsent[11] = False
    queue = [torch.tensor([1, 2, 3]), torch.tensor([10, 11, 12])]  # oldest first
    ids, rest = decide.take_hints(queue, unsent, 1)
    assert ids.tolist() == [10] and [r.tolist() for r in rest] == [[1, 2, 3], [12]]
    assert len(queue) == 2 and queue[1].tolist() == [10, 11, 12]  # the caller's queue is not changed
    ids, rest = decide.take_hints(rest, unsent, 3)
    assert ids.tolist() == [12, 1, 2] and [r.tolist() for r in rest] == [[3]]
    ids, rest = decide.take_hints(queue, unsent, None)
    assert ids.tolist() == [10, 12] and len(rest) == 1  # the newest notice only
    ids, rest = decide.take_hints([], unsent, 5)
    assert ids.numel() == 0 and rest == []
    wants = decide.entry_wants(torch.tensor([7, 24, 27]), 2, 10, 2)  # (0, 3, 1), (1, 2, 0), (1, 3, 1)
    assert [(layer, want.nonzero().tolist()) for layer, want in wants] == [(0, [[3, 1]]), (1, [[2, 0], [3, 1]])]
    ids = torch.randperm(4 * 10 * 2, generator=torch.Generator().manual_seed(3))[:9]  # any layers, in any order
    wants = decide.entry_wants(ids, 4, 10, 2)
    entries = {(layer, token, head) for layer, want in wants for token, head in want.nonzero().tolist()}
    assert entries == {(i // 20, i % 20 // 2, i % 2) for i in ids.tolist()}
    assert [layer for layer, _ in wants] == sorted({i // 20 for i in ids.tolist()})


def test_a_push_bridges_only_gaps_this_node_sent_and_only_on_a_fast_link():
    token = 2 * 16
    unsent = torch.ones(2, 30, 2, dtype=torch.bool)
    unsent[:, 10:20] = False
    slow = decide.RUN_COST_S
    assert decide.bridge(16, 0.0, unsent, 0, None) == (0, None)  # no rate measured yet
    assert decide.bridge(16, token / slow * 0.5, unsent, 0, None) == (0, None)  # bytes cost more than descriptors
    assert decide.bridge(16, token, None, 0, None) == (0, None)
    held = torch.zeros(2, 30, dtype=torch.bool)
    held[1, 15] = True
    tokens, resendable = decide.bridge(16, token / slow * 4.5, unsent, 12, held)
    assert tokens == 4 and resendable is not None
    assert not resendable[:, :12].any() and resendable[0, 12:20].all() and not resendable[1, 15].any()
    assert not resendable[:, 20:].any() and unsent[:, 20:].all()  # the request's own unsent is left alone


# (prompt tokens, blocks M, layers, share of entries sent) and (link rate, idle window, fetched bytes)
_PROMPTS = st.tuples(st.integers(1, 90), st.integers(1, 40), st.integers(1, 3), st.sampled_from([0.0, 0.5, 0.9, 1.0]))
_LINKS = st.tuples(st.sampled_from([0.0, 1e3, 1e5, 1e12]), st.sampled_from([0.0, 1e-3, 1e-2]), st.sampled_from([0, 10]))


@settings(max_examples=150, deadline=None)
@given(prompt=_PROMPTS, link=_LINKS, seed=st.integers(0, 10**6), size=st.integers(1, 50))
def test_a_slice_looked_up_block_by_block_is_the_slice_of_every_blocks_count(prompt, link, seed, size):
    """`block_pending` counts the blocks asked as `pending_tokens` counts them all, and `next_slice` looking up only
    as much of the order as it needs takes the same slice (or None) as with every block's count at hand."""
    length, num_blocks, layers, sent_share = prompt
    rate, window, fetched = link
    generator = torch.Generator().manual_seed(seed)
    unsent = torch.rand(layers, length, 2, generator=generator) >= sent_share
    every = decide.pending_tokens(unsent, length, num_blocks, effective_blocks(length, num_blocks))
    looked_up = decide.block_pending(unsent, length, num_blocks)
    ahead = torch.randperm(every.numel(), generator=generator)
    assert torch.equal(looked_up(ahead).float(), every[ahead])
    kwargs = {"size": size, "num_blocks": every.numel() // layers, "link_rate": rate, "window": window}
    whole = decide.next_slice(ahead, pending=every, fetched=fetched, token_bytes=16, **kwargs)
    lazy = decide.next_slice(ahead, pending=looked_up, fetched=fetched, token_bytes=16, **kwargs)
    if whole is None:
        assert lazy is None
    else:
        assert lazy is not None and torch.equal(lazy.ids, whole.ids) and lazy.advance == whole.advance
