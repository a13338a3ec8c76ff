"""The decode side's per-step decisions, as pure functions: no lane, thread, pool or model."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smartgen.engine.decode import decide
from smartgen.engine.decode.decide import CHAINED_NOTICE_LAYERS, DecodeFlags, Notice
from smartgen.engine.decode.move import fetch_message
from smartgen.engine.index_ops import split_reorder_reference
from smartgen.engine.mask import LOCAL, PAD, REMOTE
from smartgen.engine.policy import POLICIES

SPECULATIVE = DecodeFlags(speculative=True)
CHAINED = DecodeFlags(speculative=True, chain=True, hints=0.5, prefetch=True)


def _split(index: list[list[int]], mask: list[list[int]]):
    """An IndexSplit of one slot: `index` [H, k] token ids, `mask` [n, H] status per token and head."""
    masks = torch.tensor(mask, dtype=torch.int8).unsqueeze(0)  # [1, n, H]
    rows = torch.tensor(index, dtype=torch.int64)
    return split_reorder_reference(rows, masks, torch.tensor([0]), rows.shape[0])


@pytest.mark.parametrize("name", list(POLICIES))
def test_flags_read_every_policy_once(name):
    policy, flags = POLICIES[name], DecodeFlags.of(POLICIES[name])
    assert (flags.parallel, flags.speculative, flags.chain) == (policy.parallel, policy.speculative, policy.chain)
    assert (flags.drop_remote, flags.prefetch, flags.hints) == (policy.drop_remote, policy.prefetch, policy.hints)
    assert flags.quantized == bool(policy.quantize_bits)


@pytest.mark.parametrize(
    "bad",
    [
        {"hints": 0.5},  # hints without speculation
        {"hints": -1.0, "speculative": True},
        {"chain": True},
        {"drop_remote": True, "prefetch": True},
        {"drop_remote": True, "speculative": True},
    ],
)
def test_flags_refuse_what_no_policy_can_be(bad):
    with pytest.raises(ValueError):
        DecodeFlags(**bad)


def _notices(flags: DecodeFlags, num_layers: int, steps: int = 1, **state) -> list[list[int]]:
    """The layers of each step whose start sends an idle notice, the count carried across layers and steps."""
    count, sent = 0, []
    for _ in range(steps):
        step = []
        for layer in range(num_layers):
            notice = decide.plan_notice(flags, layers_since_notice=count, **state)
            count = notice.layers_since_notice
            if notice.send:
                step.append(layer)
        sent.append(step)
    return sent


def test_notices_every_layer_for_the_paper_and_every_few_when_chained():
    live = {"live": True, "first_step": False, "fetch_in_flight": False}
    assert _notices(SPECULATIVE, 8, **live) == [list(range(8))]
    assert CHAINED_NOTICE_LAYERS == 4
    assert _notices(CHAINED, 8, steps=2, **live) == [[0, 4], [0, 4]]  # the count runs on across steps
    assert _notices(CHAINED, 6, steps=2, **live) == [[0, 4], [2]]


@pytest.mark.parametrize(
    "state",
    [
        {"live": False, "first_step": False, "fetch_in_flight": False},  # released, failed or resuming
        {"live": True, "first_step": True, "fetch_in_flight": False},  # TTST's fetches have the link
        {"live": True, "first_step": False, "fetch_in_flight": True},  # the link is not idle
    ],
)
def test_no_notice_when_the_link_is_not_idle_or_the_request_is_done(state):
    assert _notices(SPECULATIVE, 4, **state) == [[]]
    assert _notices(DecodeFlags(), 4, live=True, first_step=False, fetch_in_flight=False) == [[]]  # no speculation
    held = decide.plan_notice(CHAINED, layers_since_notice=2, **state)
    assert held == Notice(False, 2)  # a quiet layer does not count towards a chained notice


def test_a_notice_checks_itself():
    with pytest.raises(ValueError):
        Notice(True, 3)
    with pytest.raises(ValueError):
        Notice(False, -1)


def test_hints_and_prefetch_only_where_they_can_help():
    assert decide.hint_ratio(CHAINED, released=False) == 0.5
    assert decide.hint_ratio(CHAINED, released=True) == 0.0  # all local: nothing to push ahead
    assert decide.hint_ratio(SPECULATIVE, released=False) == 0.0
    assert decide.prefetches(CHAINED, first_step=False, released=False)
    assert not decide.prefetches(CHAINED, first_step=True, released=False)  # the first step waits on the link
    assert not decide.prefetches(CHAINED, first_step=False, released=True)
    assert not decide.prefetches(SPECULATIVE, first_step=False, released=False)
    assert decide.prefetch_layer(3, layer_has_remote=True, remote_met_before=None)  # no step yet: try
    assert decide.prefetch_layer(3, layer_has_remote=True, remote_met_before={3})
    assert not decide.prefetch_layer(3, layer_has_remote=True, remote_met_before={2})  # last step found it local
    assert not decide.prefetch_layer(3, layer_has_remote=False, remote_met_before=None)


def test_remote_entries_are_flat_token_head_ids_less_what_was_asked():
    # 2 heads; token 1 is remote in head 0 only, token 3 in both, token 0 local, token 2 padding
    mask = [[LOCAL, LOCAL], [REMOTE, LOCAL], [PAD, PAD], [REMOTE, REMOTE]]
    index = torch.tensor([[3, 1, 0, 3], [1, 3, 0, 2]])
    status = torch.tensor(mask, dtype=torch.int8)[index, torch.arange(2)[:, None]]
    entries = decide.remote_entries(index, status)
    assert entries.tolist() == [1 * 2 + 0, 3 * 2 + 0, 3 * 2 + 1]  # sorted, unique, head 1 of token 1 not moved
    assert decide.remote_entries(index, status, [torch.tensor([6]), torch.tensor([2])]).tolist() == [7]
    message = fetch_message("r", 5, 9, entries, 2)
    assert message.positions.tolist() == [1, 3]
    assert message.heads.tolist() == [[True, False], [True, True]]


def _masks(layers: int, slots: int, tokens: int, heads: int, value: int = LOCAL) -> torch.Tensor:
    return torch.full((layers, slots, tokens, heads), value, dtype=torch.int8)


def test_hints_name_the_remote_entries_of_a_wider_selection():
    masks = _masks(4, 2, 12, 2)  # slot 1 holds a 10-token request
    masks[2, 1, 4, 0] = masks[2, 1, 2, 1] = REMOTE
    masks[2, 1, 1, 1] = REMOTE  # remote, but only head 0 picked token 1, where it is local: not named
    masks[2, 0, 1, 0] = REMOTE  # another slot's entry: not this request's
    wide = torch.tensor([[4, 1], [4, 2]])  # layer 2, heads 0 and 1
    # (2 * 10 + 4) * 2 + 0 and (2 * 10 + 2) * 2 + 1, column by column: each (token, head) named alone
    assert decide.hinted([(2, wide)], masks, 1, 10, None).tolist() == [48, 45]
    assert decide.hinted([(3, wide)], masks, 1, 10, None) is None  # all local in layer 3
    assert decide.hinted([], masks, 1, 10, None) is None
    kept = torch.tensor([7, 48])
    assert decide.hinted([], masks, 1, 10, kept).tolist() == [7, 48]
    assert decide.hinted([(2, wide)], masks, 1, 10, kept).tolist() == [48, 45, 7]  # the older after, once each


def test_a_notice_names_its_entries_rank_by_rank_across_layers_and_heads():
    """Rows likeliest first give a notice likeliest first: every noted layer's and head's first pick, then their
    second, ..., so a prefill node that takes only the front of a notice takes each layer's best."""
    masks = _masks(4, 1, 10, 2, REMOTE)
    noted = [(2, torch.tensor([[5, 1], [0, 7]])), (3, torch.tensor([[9, 2], [4, 3]]))]
    ids = decide.hinted(noted, masks, 0, 10, None)
    assert ids is not None
    ranks = [(2 * 10 + 5) * 2, (2 * 10 + 0) * 2 + 1, (3 * 10 + 9) * 2, (3 * 10 + 4) * 2 + 1]
    seconds = [(2 * 10 + 1) * 2, (2 * 10 + 7) * 2 + 1, (3 * 10 + 2) * 2, (3 * 10 + 3) * 2 + 1]
    assert ids.tolist() == ranks + seconds


@given(st.lists(st.integers(0, 20), max_size=40))
def test_distinct_in_order_keeps_each_id_where_it_first_occurs(values):
    from smartgen.engine.index_ops import distinct_in_order

    expected = list(dict.fromkeys(values))
    assert distinct_in_order(torch.tensor(values, dtype=torch.int64)).tolist() == expected


def test_hints_read_every_noted_layer_and_width_and_never_padding_or_positions_past_the_prompt():
    """A notice's hints are the union of every noted layer's, each layer at its own offset (layer * length), rows of
    different widths included; padding (-1) and positions past the prompt are never named."""
    masks = _masks(4, 1, 12, 1, REMOTE)
    noted = [(1, torch.tensor([[3, -1]])), (2, torch.tensor([[0, 9, 11]])), (1, torch.tensor([[3, 5]]))]
    assert decide.hinted(noted, masks, 0, 10, None).tolist() == [13, 15, 20, 29]


@given(
    st.integers(1, 3),
    st.integers(2, 12),
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=6),
    st.integers(0, 2**16),
)
def test_hints_read_at_once_are_what_each_layer_read_alone_names(heads, length, notes, seed):
    """Reading every noted layer's status in one pass names exactly the entries each note, read alone against its
    own layer's mask, names as remote in their head, each once (a layer noted twice included)."""
    generator = torch.Generator().manual_seed(seed)
    masks = torch.randint(0, 3, (4, 2, length + 2, heads), generator=generator, dtype=torch.int8)

    def rows(width: int) -> torch.Tensor:  # as a selector picks: each position at most once a row, -1 padded
        picks = [torch.randperm(length + 2, generator=generator)[:width] - 1 for _ in range(heads)]
        return torch.stack([torch.where(p >= 0, p, -1) for p in picks])

    noted = [(layer, rows(width)) for layer, width in notes]
    expected = set()
    for layer, rows in noted:
        for h in range(heads):
            for t in rows[h].tolist():
                if 0 <= t < length and masks[layer, 1, t, h] == REMOTE:
                    expected.add((layer * length + t) * heads + h)
    got = [] if (ids := decide.hinted(noted, masks, 1, length, None)) is None else ids.tolist()
    assert set(got) == expected and len(got) == len(expected)


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 3),
    tokens=st.integers(1, 12),
    k=st.integers(1, 8),
    seed=st.integers(0, 10_000),
    drop=st.lists(st.booleans(), min_size=1, max_size=3),
    parallel=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_an_assembly_drops_and_gathers_each_request_by_its_own_flags(heads, tokens, k, seed, drop, parallel):
    """Dropped requests keep exactly their local entries (rows local-first, remote now padding); the others are
    left as the split made them; a parallel request gathers all its local entries early, a sequential none."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(drop)
    parallel = parallel[:batch]
    masks = torch.randint(0, 3, (batch, tokens, heads), generator=generator, dtype=torch.int8)
    index = torch.randint(-1, tokens + 1, (batch * heads, k), generator=generator)
    split = split_reorder_reference(index, masks, torch.arange(batch), heads)
    plan = decide.plan_assembly(split, drop=drop, parallel=parallel)
    assert plan.all_parallel == all(parallel)
    for b in range(batch):
        rows = slice(b * heads, (b + 1) * heads)
        if drop[b]:
            assert plan.split.num_remote[rows].tolist() == [0] * heads
            assert plan.dropped[rows].tolist() == split.num_remote[rows].tolist()
            for row in range(rows.start, rows.stop):
                local = int(split.num_local[row])
                kept = plan.split.index[row, :local].tolist()
                was = split.index[row][split.status[row] == LOCAL].tolist()
                assert kept == was, "a dropped row keeps its local entries, in order, first"
                assert (plan.split.status[row, local:] != LOCAL).all() and (plan.split.status[row] != REMOTE).all()
        else:
            assert plan.dropped[rows].tolist() == [0] * heads
            assert torch.equal(plan.split.index[rows], split.index[rows])
            assert torch.equal(plan.split.status[rows], split.status[rows])
        early = plan.num_valid[rows] if parallel[b] else plan.split.num_remote[rows]
        assert plan.early_stop[rows].tolist() == early.tolist()


def test_an_assembly_needs_one_flag_of_each_per_request():
    split = _split([[0, 1], [1, 0]], [[LOCAL, REMOTE], [REMOTE, LOCAL]])
    with pytest.raises(ValueError):
        decide.plan_assembly(split, drop=[False], parallel=[True, True])
    with pytest.raises(ValueError):
        decide.plan_assembly(split, drop=[False] * 3, parallel=[True] * 3)  # 2 rows are not 3 requests' heads
    plan = decide.plan_assembly(split, drop=[False], parallel=[True])
    with pytest.raises(ValueError):
        decide.AssemblyPlan(plan.split, plan.dropped[:1], plan.early_stop, True)


def test_the_no_hints_ablation_is_smartgen_without_hints():
    """`smartgen-no-hints` differs from `smartgen` in its hints alone, and never ranks wider than its budget."""
    ours, ablation = DecodeFlags.of(POLICIES["smartgen"]), DecodeFlags.of(POLICIES["smartgen-no-hints"])
    assert decide.hint_ratio(ours, released=False) > 0
    assert decide.hint_ratio(ablation, released=False) == 0
    assert dataclasses.replace(ablation, hints=ours.hints) == ours
    assert dataclasses.replace(POLICIES["smartgen-no-hints"], name="smartgen", hints=0.5) == POLICIES["smartgen"]
