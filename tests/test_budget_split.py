"""Budget splits over heads (Ada-KV) and layers (PyramidKV): totals kept, rows well formed, selectors honour them."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smartgen.selectors import ModelInfo, StepQuery, make_selector
from smartgen.selectors.base import FIRST_SPARSE_LAYER, PrefillLayer, budget_tokens
from smartgen.selectors.budget_split import adaptive_order, layer_budget, top_rows

INFO = ModelInfo(num_layers=8, num_q_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32)


def _picked(rows: torch.Tensor) -> list[list[int]]:
    return [[int(x) for x in row if x >= 0] for row in rows]


def _well_formed(rows: torch.Tensor) -> None:
    for row in rows.tolist():
        valid = [x for x in row if x >= 0]
        assert row[: len(valid)] == valid, "padding only after a row's picks"
        assert valid == sorted(set(valid)), "picks ascending, no repeats"


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 4),
    m=st.integers(1, 40),
    count=st.integers(1, 40),
    floor=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
    seed=st.integers(0, 10_000),
)
def test_adaptive_rows_keep_the_total_and_each_head_its_floor(heads, m, count, floor, seed):
    scores = torch.rand(heads, m, generator=torch.Generator().manual_seed(seed))
    rows = top_rows(scores, count, "adaptive", floor)
    _well_formed(rows)
    picked = _picked(rows)
    count = min(count, m)
    assert sum(map(len, picked)) == heads * count
    assert all(len(p) >= min(m, math.ceil(floor * count - 1e-9)) for p in picked)
    if floor == 0.0:  # then it is the plain top over all heads at once
        best = set(scores.flatten().topk(heads * count).indices.tolist())
        assert {h * m + x for h, p in enumerate(picked) for x in p} == best
    if floor == 1.0:  # then every head keeps its own top count: the even split
        assert picked == _picked(top_rows(scores, count, "even"))


def test_adaptive_gives_a_concentrated_heads_entries_to_a_spread_one():
    sharp = torch.zeros(40)
    sharp[[3, 17]] = 1.0  # head 0 needs two tokens
    spread = torch.linspace(0.5, 0.9, 40)  # head 1 ranks everything well above head 0's rest
    rows = top_rows(torch.stack([sharp, spread]), 10, "adaptive", floor=0.2)
    picked = _picked(rows)
    assert picked[0] == [3, 17]
    assert len(picked[1]) == 18 and picked[1] == list(range(22, 40))


def test_even_rows_are_the_per_head_top():
    scores = torch.rand(3, 50, generator=torch.Generator().manual_seed(1))
    rows = top_rows(scores, 7, "even")
    assert rows.shape == (3, 7)
    assert _picked(rows) == [sorted(r.topk(7).indices.tolist()) for r in scores]


def test_adaptive_order_puts_every_heads_floor_first():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.1, 0.2, 0.0, 0.05]])
    order = adaptive_order(scores, 2, floor=0.5).tolist()  # one reserved pick per head
    assert set(order[:2]) == {0, 4 + 1}
    assert order[2:4] == [1, 2]


@pytest.mark.parametrize("budget", [0.1, 0.3, 12.0])
def test_pyramid_keeps_the_mean_budget_and_falls_with_depth(budget):
    layers = range(FIRST_SPARSE_LAYER, 18)
    shares = [layer_budget(budget, layer, 18, "pyramid", 0.5) for layer in layers]
    assert sum(shares) / len(shares) == pytest.approx(budget)
    assert shares == sorted(shares, reverse=True)
    assert shares[0] == pytest.approx(1.5 * budget) and shares[-1] == pytest.approx(0.5 * budget)
    assert all(layer_budget(budget, layer, 18, "even", 0.5) == budget for layer in layers)


def test_pyramid_never_asks_more_than_the_whole_prompt():
    assert layer_budget(0.9, FIRST_SPARSE_LAYER, 10, "pyramid", 0.5) == 1.0


def _metadata(selector, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    metadata = []
    for layer in range(INFO.num_layers):
        keys = torch.randn(INFO.num_kv_heads, n, INFO.head_dim, generator=g)
        queries = torch.randn(INFO.num_q_heads, n, INFO.head_dim, generator=g)
        metadata.append(selector.build_metadata(PrefillLayer(layer, queries, keys, None)))
    return metadata


def _step(layer: int, n: int, seed: int) -> StepQuery:
    query = torch.randn(1, INFO.num_q_heads, INFO.head_dim, generator=torch.Generator().manual_seed(seed))
    return StepQuery(layer, query, None, torch.tensor([n]), [n])


@pytest.mark.parametrize("name,extra", [("topk", {}), ("quest", {"page_size": 4}), ("hata", {"rbit": 32})])
def test_selectors_spend_the_same_total_under_an_adaptive_head_split(name, extra):
    n = 200
    even = make_selector(name, INFO, budget=0.2, **extra)
    adaptive = make_selector(name, INFO, budget=0.2, head_split="adaptive", **extra)
    for layer in range(FIRST_SPARSE_LAYER, INFO.num_layers):
        meta = _metadata(even, n, layer)
        a, e = (
            adaptive.select(_step(layer, n, layer), [meta[layer]]),
            even.select(_step(layer, n, layer), [meta[layer]]),
        )
        _well_formed(a)
        assert sum(map(len, _picked(a))) == sum(map(len, _picked(e)))


@pytest.mark.parametrize("name,extra", [("topk", {}), ("quest", {"page_size": 4}), ("hata", {"rbit": 32})])
def test_selectors_give_early_layers_more_under_a_pyramid(name, extra):
    n = 400
    pyramid = make_selector(name, INFO, budget=0.2, layer_split="pyramid", slope=0.5, **extra)
    sizes = []
    for layer in (FIRST_SPARSE_LAYER, INFO.num_layers - 1):
        meta = _metadata(pyramid, n, layer)
        rows = pyramid.select(_step(layer, n, layer), [meta[layer]])
        sizes.append(len(_picked(rows)[0]))
    assert sizes[0] == pytest.approx(budget_tokens(0.3, n), abs=4)
    assert sizes[1] == pytest.approx(budget_tokens(0.1, n), abs=4)


def test_quest_wide_pick_contains_the_narrow_one_under_an_adaptive_split():
    n = 300
    quest = make_selector("quest", INFO, budget=0.1, page_size=4, head_split="adaptive")
    wide = quest.widened(0.5)
    layer = 3
    meta = _metadata(quest, n, 0)[layer]
    narrow, widened = quest.select_with_next(_step(layer, n, 5), [meta], wide)  # the adaptive split: the wide pick
    assert _picked(narrow) == _picked(quest.select(_step(layer, n, 5), [meta]))
    assert _picked(widened) == _picked(wide.select(_step(layer, n, 5), [meta]))
    for small, big in zip(_picked(narrow), _picked(widened)):
        assert set(small) <= set(big)


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("quest", {"head_split": "pyramid"}, "head_split must be one of even, adaptive"),
        ("hata", {"layer_split": "adaptive"}, "layer_split must be one of even, pyramid"),
        ("topk", {"layer_split": "pyramid", "slope": 1.5}, "slope must be in [0, 1)"),
        ("quest", {"head_split": "adaptive", "gqa": "bound"}, "needs gqa=max"),
        ("hata", {"head_split": "adaptive", "gqa": "sum"}, "needs gqa=max"),
    ],
)
def test_bad_split_parameters_are_refused_in_one_line(name, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_selector(name, INFO, **params)
