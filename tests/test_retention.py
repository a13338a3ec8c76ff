"""Prefix-cache retention: the reuse model, miss costs, the LRU and cost policies as pure logic, and the cache's chain."""

import random

import pytest
import torch

from smartgen.engine.prefix_cache import PrefixCache
from smartgen.engine.retention import (
    ComputeCost,
    CostRetention,
    LinkCost,
    LruRetention,
    make_retention,
)
from smartgen.engine.reuse_model import ReuseModel

BLOCK = 4


def _all(key: bytes) -> bool:
    return True


# -- the reuse model -------------------------------------------------------------------------------
def test_before_any_data_the_model_ranks_by_age_alone_as_lru_does():
    model = ReuseModel()
    ages = [0.0, 1.0, 10.0, 100.0, 1000.0]
    rates = [model.rate(0, age) for age in ages]
    assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1]
    assert all(model.rate(hits, 10.0) == rates[2] for hits in range(6))  # no class is favoured yet


def test_the_model_learns_that_hit_blocks_are_reused_and_stored_only_ones_are_not():
    model = ReuseModel(rebuild_every=10)
    for _ in range(200):
        model.observe(0, 30.0, False)  # stored, never hit, forgotten at 30 s
        model.observe(1, 5.0, True)  # hit once, hit again 5 s later
    assert model.rate(1, 1.0) > 10 * model.rate(0, 1.0)
    assert model.reuse_probability(1, 1.0) > 0.9 > 0.3 > model.reuse_probability(0, 1.0)


def test_old_observations_count_half_after_a_half_life():
    model = ReuseModel(rebuild_every=1, half_life=100)
    for _ in range(99):
        model.observe(2, 1.0, True)
    before = model.reuse_probability(2, 0.0)
    for _ in range(101):  # the halving happens at 100; then the workload turns: no more reuse
        model.observe(2, 1.0, False)
    assert model.reuse_probability(2, 0.0) < before


# -- what a miss costs -----------------------------------------------------------------------------
def test_a_link_miss_costs_its_bytes_at_the_link_rate_wherever_the_block_is():
    cost = LinkCost(8.0)
    assert cost.seconds(0, 10**9) == pytest.approx(1.0) == cost.seconds(50, 10**9)
    with pytest.raises(ValueError):
        LinkCost(0.0)


def test_a_recompute_miss_grows_with_the_block_s_position():
    cost = ComputeCost.for_model(num_parameters=10**9, num_layers=2, query_width=64, block_tokens=16)
    first, later = cost.seconds(0, 1), cost.seconds(100, 1)
    assert later > first
    t = 16  # block 1: 16 tokens, each attending to the 16 before it plus itself and its predecessors in the block
    pairs = t * t + t * (t + 1) / 2
    assert cost.seconds(1, 1) == pytest.approx((t * 2e9 + pairs * 4 * 2 * 64) / 100e12)


# -- the policies ----------------------------------------------------------------------------------
def test_lru_evicts_the_least_recently_used_evictable_block():
    lru = LruRetention()
    for i, key in enumerate([b"a", b"b", b"c"]):
        lru.added(key, i, 1, float(i))
    lru.hit(b"a", 5.0)
    assert lru.victim(6.0, _all) == b"b"
    assert lru.victim(6.0, lambda key: key != b"b") == b"c"
    lru.removed(b"b", 6.0)
    assert lru.victim(6.0, _all) == b"c"


def _trained(model: ReuseModel) -> ReuseModel:
    for _ in range(300):
        model.observe(0, 20.0, False)
        model.observe(1, 2.0, True)
        model.observe(2, 2.0, True)
    return model


def test_cost_keeps_the_block_with_more_hits_and_evicts_the_stale_one():
    policy = CostRetention(LinkCost(10.0), model=_trained(ReuseModel(rebuild_every=10)), candidates=2)
    policy.added(b"once", 0, 100, 0.0)
    policy.added(b"twice", 0, 100, 0.0)
    policy.hit(b"twice", 1.0)
    policy.hit(b"twice", 2.0)
    assert policy.victim(3.0, _all) == b"once"


def test_cost_weighs_the_miss_cost_per_byte():
    class ByIndex:
        def seconds(self, index: int, nbytes: int) -> float:
            return float(index + 1)

    policy = CostRetention(ByIndex())
    policy.added(b"cheap", 0, 100, 0.0)
    policy.added(b"dear", 9, 100, 0.0)  # same history, ten times the miss cost
    assert policy.victim(1.0, _all) == b"cheap"


def test_cost_offers_only_what_the_cache_may_evict_and_weighs_it_at_its_own_recency():
    policy = CostRetention(LinkCost(10.0))
    policy.added(b"head", 0, 100, 0.0)
    policy.added(b"tail", 1, 100, 50.0)  # younger: the head alone would go first
    assert policy.victim(60.0, _all) == b"head"
    assert policy.victim(60.0, lambda key: key != b"head") == b"tail"  # the cache says the head has a child
    policy.removed(b"tail", 60.0)
    assert policy.victim(60.0, _all) == b"head"


def test_an_evicted_block_that_comes_back_gets_its_hit_history_back():
    policy = CostRetention(LinkCost(10.0))
    policy.added(b"x", 0, 100, 0.0)
    for t in (1.0, 2.0, 3.0):
        policy.hit(b"x", t)
    policy.removed(b"x", 4.0)
    observed = policy.model.observations
    policy.added(b"x", 0, 100, 10.0)
    assert policy._entries[b"x"].hits == 4  # three hits, and this return counts as a fourth reuse
    assert policy.model.observations == observed + 1  # the missed reuse was learned from


def test_admission_declines_a_new_block_worth_less_than_everything_it_would_evict():
    model = _trained(ReuseModel(rebuild_every=10))
    policy = CostRetention(LinkCost(10.0), model=model, admission=True)
    policy.added(b"hot", 0, 100, 0.0)
    policy.hit(b"hot", 1.0)
    policy.hit(b"hot", 2.0)
    assert policy.victim(2.5, _all, incoming=(b"new", 0, 100)) is None and policy.declined == 1
    assert policy.victim(2.5, _all) == b"hot"  # without an incoming block the victim is still named
    # seen before and declined: it comes back with that history and is worth more now
    assert policy._ghosts[b"new"][0] == 0
    off = CostRetention(LinkCost(10.0), model=model)  # the default: every new block is stored
    off.added(b"hot", 0, 100, 0.0)
    assert off.victim(2.5, _all, incoming=(b"new", 0, 100)) == b"hot"


def test_make_retention_names_the_policies_and_refuses_others():
    assert make_retention("lru").name == "lru"
    assert make_retention("cost", LinkCost(1.0)).name == "cost"
    with pytest.raises(ValueError, match="needs a miss cost"):
        make_retention("cost")
    with pytest.raises(ValueError, match="lru, cost"):
        make_retention("lfu")


# -- the cache keeps the chain ---------------------------------------------------------------------
def _kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, n, 1, 1), torch.zeros(1, n, 1, 1)


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_no_cached_block_ever_outlives_its_parent_and_the_budget_holds(policy):
    clock = [0.0]
    block_bytes = 2 * BLOCK * 4
    cache = PrefixCache(
        12 * block_bytes, BLOCK, retention=make_retention(policy, LinkCost(1.0)), clock=lambda: clock[0]
    )
    rng = random.Random(7)
    stems = [[rng.randrange(1000) for _ in range(BLOCK * rng.randint(1, 4))] for _ in range(6)]
    for step in range(300):
        clock[0] = float(step)
        prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(BLOCK * rng.randint(0, 5))]
        hit = cache.match(prompt)
        start = (hit.tokens // BLOCK) * BLOCK if hit is not None else 0
        cache.release(hit)
        cache.insert(prompt, *_kv(len(prompt) - start), start=start)
        assert cache.bytes_held <= cache.budget_bytes
        for key, block in cache._blocks.items():
            assert block.parent is None or block.parent in cache._blocks, "a block outlived its prefix"
            assert block.children == sum(1 for b in cache._blocks.values() if b.parent == key)
    snap = cache.snapshot()
    assert snap["hits"] > 0 and snap["evicted_blocks"] > 0 and snap["retention"]["name"] == policy


def test_a_pinned_prefix_is_not_evicted_by_the_cost_policy():
    block_bytes = 2 * BLOCK * 4
    cache = PrefixCache(3 * block_bytes, BLOCK, retention=make_retention("cost", LinkCost(1.0)))
    first = list(range(3 * BLOCK))
    cache.insert(first, *_kv(len(first)))
    hit = cache.match(first)  # pins all three
    assert cache.insert(list(range(100, 100 + BLOCK)), *_kv(BLOCK)) == 0  # no room: nothing evictable
    assert cache.snapshot()["refused_blocks"] == 1 and cache.num_blocks == 3
    cache.release(hit)
    assert cache.insert(list(range(100, 100 + BLOCK)), *_kv(BLOCK)) == 1


def test_a_long_run_of_blocks_with_children_does_not_hide_the_evictable_one_behind_it():
    policy = CostRetention(LinkCost(10.0), candidates=1)  # looks at 16 a class before it looks at all
    keys = [bytes([i]) for i in range(40)]
    for i, key in enumerate(keys):
        policy.added(key, i, 100, float(i))
    assert policy.victim(50.0, lambda key: key == keys[-1]) == keys[-1]
    assert policy.victim(50.0, lambda key: False) is None
