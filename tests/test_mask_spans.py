"""MaskTable's span questions read from each layer's local prefix and answer as a full read of the span would."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import smartgen.engine.mask as mask_module
from smartgen.engine.mask import LOCAL, PAD, REMOTE, MaskTable


def _full_read(table: MaskTable, layer: int, slot: int, start: int, stop: int) -> bool:
    return bool((table.values[layer, slot, start:stop] == LOCAL).all())


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(1, 300),
    rounds=st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, 2), st.integers(0, 299), st.integers(0, 2)), max_size=6),
            st.integers(0, 320),
            st.integers(0, 320),
        ),
        min_size=1,
        max_size=8,
    ),
    scan=st.sampled_from([1, 7, 64]),
)
def test_span_answers_equal_a_full_read_as_entries_land(length, rounds, scan):
    """Entries land (REMOTE -> LOCAL, one head or a whole run of tokens) between questions about random spans: every
    answer, per layer and for all layers at once, is the full read's, and the prefix never passes a non-local entry
    nor the prompt."""
    old = mask_module.SCAN_TOKENS
    mask_module.SCAN_TOKENS = scan  # small reads: many rounds of doubling in a short slot
    try:
        table = MaskTable(3, 2, 320, 2)
        table.open(1, length)
        for landings, a, b in rounds:
            for layer, token, run in landings:
                table.values[layer, 1, token : min(token + run * 40 + 1, length)] = LOCAL
            start, stop = min(a, b), max(a, b)
            for layer in range(3):
                assert table.span_local(layer, 1, start, stop) == _full_read(table, layer, 1, start, stop)
                below = table.local_below(layer, 1)
                assert below <= length and _full_read(table, layer, 1, 0, below)
            expect = [_full_read(table, layer, 1, start, stop) for layer in range(3)]
            assert table.spans_local(range(3), 1, start, stop) == expect
            assert table.spans_local(range(3), 1, start, stop, all_of=True) == [all(expect)] * 3
            assert table.all_local(1, length) == bool((table.values[:, 1, :length] == LOCAL).all())
    finally:
        mask_module.SCAN_TOKENS = old


def test_a_reopened_slot_starts_over():
    """The prefix belongs to the slot's request: close and open forget it, so a new request's remote prompt is never
    taken for the last one's local KV."""
    table = MaskTable(2, 1, 100, 4)
    table.open(0, 80)
    table.values[:, 0, :80] = LOCAL
    assert table.all_local(0, 80) and table.local_below(1, 0) == 80
    table.close(0)
    assert table.local_below(0, 0) == 0 and not table.span_local(0, 0, 0, 1)  # padding is not local
    table.open(0, 90)
    assert not table.all_local(0, 90) and not table.span_local(1, 0, 10, 20)


def test_generated_tokens_are_read_each_time():
    """The prefix stops at the prompt: a generated token taken back and not yet rewritten (its mask no longer
    LOCAL) is seen as such, whatever was read before."""
    table = MaskTable(1, 1, 50, 2)
    table.open(0, 30)
    table.values[0, 0, :33] = LOCAL  # the prompt and three generated tokens
    assert table.span_local(0, 0, 0, 33) and table.local_below(0, 0) == 30
    table.values[0, 0, 32] = PAD
    assert not table.span_local(0, 0, 0, 33) and table.span_local(0, 0, 0, 32)


def test_a_span_past_the_prefix_does_not_grow_it():
    """A span that starts past the local prefix (a window layer's) says nothing about the tokens before it."""
    table = MaskTable(1, 1, 64, 1)
    table.open(0, 64)
    table.values[0, 0, 40:] = LOCAL
    assert table.span_local(0, 0, 40, 64) and table.local_below(0, 0) == 0
    table.values[0, 0, 5] = REMOTE
    assert not table.all_local(0, 64)


def test_a_slot_never_opened_is_read_whole():
    """Masks written without `open` (a table used directly) have no prompt: nothing is remembered, every question
    reads the span."""
    table = MaskTable(1, 1, 16, 1)
    table.values[0, 0, :8] = LOCAL
    assert table.span_local(0, 0, 0, 8) and table.local_below(0, 0) == 0
    table.values[0, 0, 3] = REMOTE
    assert not table.span_local(0, 0, 0, 8)
    assert torch.equal(table.values[0, 0, 8:], torch.zeros(8, 1, dtype=torch.int8))
