"""Prefix caching: the block cache itself, prefill after a cached prefix, and both nodes' caches in the pipeline."""

import threading

import pytest
import torch
from conftest import wait_until
from tiny_models import tiny_config

from smartgen.engine.policy import POLICIES, get_policy
from smartgen.engine.prefix_cache import PrefixCache, block_hashes
from smartgen.runtime.models import model_from_config
from smartgen.runtime.pipeline import InprocPipeline
from smartgen.runtime.prefill import PrefillRunner

L, H, D = 2, 2, 4
BLOCK = 4
BLOCK_BYTES = 2 * L * BLOCK * H * D * 4  # K and V of one block, float32


def _kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g)


# -- the cache -----------------------------------------------------------------------------
def test_a_block_key_covers_everything_before_it():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, other prefix: another key
    assert block_hashes([1, 2, 3, 4, 5, 6, 7], 4) == a[:1]  # only whole blocks have keys
    assert block_hashes([1, 2, 3, 4], 4, salt="other") != a[:1]


def test_the_longest_cached_leading_run_is_found_and_its_kv_is_the_inserted_kv():
    cache = PrefixCache(10 * BLOCK_BYTES, BLOCK)
    ids = list(range(10, 22))  # three blocks
    k, v = _kv(12)
    assert cache.insert(ids, k, v) == 3
    hit = cache.match(ids[:8] + [99, 98, 97, 96])  # the third block differs
    assert hit is not None and hit.tokens == 8
    hk, hv = hit.kv()
    assert torch.equal(hk, k[:, :8]) and torch.equal(hv, v[:, :8])
    cache.release(hit)
    capped = cache.match(ids, max_tokens=11)  # a prefill computes at least one token: 11 of 12
    assert capped is not None and capped.tokens == 11 and torch.equal(capped.kv()[0], k[:, :11])
    cache.release(capped)
    assert cache.match([1, 2, 3, 4]) is None
    snap = cache.snapshot()
    assert snap["lookups"] == 3 and snap["hit_tokens"] == 19 and snap["blocks"] == 3


def test_eviction_keeps_the_budget_and_takes_a_prefix_s_tail_before_its_head():
    cache = PrefixCache(4 * BLOCK_BYTES, BLOCK)
    first = list(range(100, 112))
    cache.insert(first, *_kv(12))
    second = list(range(200, 212))
    cache.insert(second, *_kv(12, seed=1))  # 6 blocks for 4 places: two evicted
    assert cache.bytes_held <= 4 * BLOCK_BYTES and cache.num_blocks == 4
    assert cache.snapshot()["evicted_blocks"] == 2
    hit = cache.match(first)  # the older prompt lost its tail, not its head
    assert hit is not None and hit.tokens == 4
    cache.release(hit)


def test_pinned_blocks_are_never_evicted_and_a_full_budget_refuses_new_ones():
    cache = PrefixCache(3 * BLOCK_BYTES, BLOCK)
    ids = list(range(12))
    k, v = _kv(12)
    cache.insert(ids, k, v)
    hit = cache.match(ids)
    assert hit is not None and hit.tokens == 12
    assert cache.insert(list(range(50, 62)), *_kv(12, seed=2)) == 0  # every place pinned: refused
    assert cache.snapshot()["refused_blocks"] == 1 and cache.bytes_held == 3 * BLOCK_BYTES
    assert torch.equal(hit.kv()[0], k)  # still the pinned data
    cache.release(hit)
    assert cache.insert(list(range(50, 62)), *_kv(12, seed=2)) == 3  # unpinned: evicted for the newcomer


def test_insert_from_a_block_boundary_and_a_zero_budget_is_off():
    cache = PrefixCache(10 * BLOCK_BYTES, BLOCK)
    ids = list(range(12))
    k, v = _kv(12)
    cache.insert(ids[:4], k[:, :4], v[:, :4])
    assert cache.insert(ids, k[:, 4:], v[:, 4:], start=4) == 2
    hit = cache.match(ids)
    assert hit is not None and torch.equal(hit.kv()[1], v)
    with pytest.raises(ValueError, match="multiple"):
        cache.insert(ids, k, v, start=3)
    off = PrefixCache(0, BLOCK)
    assert off.insert(ids, k, v) == 0 and off.match(ids) is None and not off.enabled


def test_concurrent_lookups_and_inserts_stay_within_budget_and_consistent():
    cache = PrefixCache(6 * BLOCK_BYTES, BLOCK)
    prompts = [[p * 1000 + t for t in range(16)] for p in range(5)]
    kvs = [_kv(16, seed=p) for p in range(5)]
    errors = []

    def work(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(200):
            p = int(torch.randint(5, (1,), generator=g))
            hit = cache.match(prompts[p])
            if hit is not None:
                if not torch.equal(hit.kv()[0], kvs[p][0][:, : hit.tokens]):
                    errors.append(p)
                cache.release(hit)
            else:
                cache.insert(prompts[p], *kvs[p])
            if cache.bytes_held > cache.budget_bytes:
                errors.append("over budget")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.snapshot()["pinned_blocks"] == 0


# -- prefill after a cached prefix ---------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma2", "qwen2"])
def test_prefill_after_a_cached_prefix_hands_off_the_same_kv_and_token(family):
    """Sliding-window layers (Gemma) included: the engine still gets every token's K/V."""
    model = model_from_config(tiny_config(family))
    runner = PrefillRunner(model, None)
    ids = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(3))
    full: dict[int, tuple] = {}
    expected = runner.run(ids, on_layer=lambda layer, k, v, meta: full.__setitem__(layer, (k, v)))
    k_all = torch.stack([full[layer][0] for layer in sorted(full)])
    v_all = torch.stack([full[layer][1] for layer in sorted(full)])
    for cached in (16, 39):  # a block-aligned prefix, and all but the last token
        got: dict[int, tuple] = {}
        out = runner.run(
            ids,
            on_layer=lambda layer, k, v, meta, got=got: got.__setitem__(layer, (k, v)),
            prefix=(k_all[:, :cached], v_all[:, :cached]),
        )
        assert out.first_token == expected.first_token
        torch.testing.assert_close(out.logits, expected.logits, atol=1e-4, rtol=1e-4)
        for layer, (k, v) in got.items():
            assert k.shape == full[layer][0].shape
            torch.testing.assert_close(k, full[layer][0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, full[layer][1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="leaves nothing"):
        runner.run(ids, prefix=(k_all, v_all))


# -- both caches in the pipeline -------------------------------------------------------------------
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return model_from_config(tiny_config("llama"))


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.randint(3, 97, (96,), generator=g)
    return [
        base,  # fills the caches
        torch.cat([base[:64], torch.randint(3, 97, (30,), generator=g)]),  # a partial hit (4 of 6 blocks)
        base[:80].clone(),  # the whole prompt cached (5 blocks): prefill computes its last token only
        torch.cat([base[:48], torch.randint(3, 97, (20,), generator=g)]),
    ]


def _run(
    model,
    scheme: str,
    selector: str,
    prefill_bytes: int,
    decode_bytes: int,
    batch: bool = False,
    new_tokens: int = NEW_TOKENS,
):
    policy = get_policy(scheme, "sequential")
    timings = {"prefill_seconds_per_token": 2e-5, "gbps": 1.0} if policy.proactive == "budget" else {}
    params = {} if selector == "dense" else {"budget": 0.25}
    with InprocPipeline(
        model,
        policy,
        selector,
        params,
        num_blocks=8,
        prefill_cache_bytes=prefill_bytes,
        decode_cache_bytes=decode_bytes,
        **timings,
    ) as pipeline:
        prompts = _prompts()
        if batch:  # a shared-prefix batch: the prefill side prefills one at a time, so later ones hit
            results = pipeline.generate(prompts, new_tokens)
        else:
            results = [r for p in prompts for r in pipeline.generate([p], new_tokens)]
        # a finished request's RELEASE reaches the prefill node after its last token (which is when generate
        # returns): the prefill side frees it, and caches its prompt, a moment later
        wait_until(lambda: pipeline.prefill_engine.store.num_requests == 0, 10, "the prefill node to free its requests")
        stats = (
            pipeline.prefill_engine.prefix_cache.snapshot(),
            pipeline.decode_engine.prefix_cache.snapshot(),
            pipeline.prefill_engine.counters.snapshot()["bytes"],
        )
        assert pipeline.decode_engine.pool.num_free == 8
    return [r.tokens for r in results], [r.metrics for r in results], stats


def _check_same(model, scheme: str, selector: str, batch: bool = False) -> None:
    expected, _, _ = _run(model, scheme, selector, 0, 0, batch)
    tokens, metrics, (prefill, decode, _) = _run(model, scheme, selector, 1 << 24, 1 << 24, batch)
    assert tokens == expected, (scheme, selector)
    assert prefill["hit_tokens"] > 0
    policy = POLICIES[scheme]  # a quantized transfer's prompt is lossy: it neither fills nor takes from the cache
    if (policy.speculative or policy.wait_for_all) and not policy.quantize_bits:
        # finished requests' prompts end up in the decode node's cache, as much of each as was local when it
        # ended: all of the first's once its KV had all landed (full transfer's before it decoded). On a loaded
        # machine the prefill node's head start may finish its 6 tokens while its push is still on the way: less
        # of it, or none, is cached then
        if not batch and (policy.wait_for_all or metrics[0].fully_local_at is not None):
            assert decode["hit_tokens"] > 0 and metrics[1].held_tokens == 64
    if not batch:
        assert metrics[1].prefill_cached_tokens == 64 and metrics[2].prefill_cached_tokens == 79


@pytest.mark.parametrize("scheme", list(POLICIES))
def test_tokens_are_identical_with_and_without_the_caches_for_every_scheme(model, scheme):
    _check_same(model, scheme, "quest")


@pytest.mark.parametrize("selector", ["dense", "topk", "infinigen"])
def test_tokens_are_identical_with_and_without_the_caches_for_other_selectors(model, selector):
    """InfiniGen reads every prompt query: the prefill node's cache stays out of its way (no hit counted)."""
    if selector == "infinigen":
        expected, _, _ = _run(model, "smartgen", selector, 0, 0)
        tokens, _, (prefill, decode, _) = _run(model, "smartgen", selector, 1 << 24, 1 << 24)
        assert tokens == expected and prefill["lookups"] == 0 and decode["hit_tokens"] > 0
        return
    _check_same(model, "smartgen", selector)


def test_a_shared_prefix_batch_hits_the_prefill_cache_with_identical_tokens(model):
    _check_same(model, "smartgen", "quest", batch=True)


def test_eviction_in_the_middle_of_a_run_changes_no_token(model):
    small = 5 * 16 * 2 * 4 * 2 * 16 * 4  # five 16-token blocks of the tiny model (K, V, 4 layers, 2 heads, d 16)
    # without the head start, whose requests end before their KV is all here (the decode node then caches little);
    # the decode node caches a prompt only once its KV is whole at the request's end, and the speculation that makes
    # it whole runs at a lower priority: 24 tokens give it time on a loaded machine (with 6, one CI run in a few
    # ended every request first and evicted nothing)
    expected, _, _ = _run(model, "smartgen-no-head-start", "quest", 0, 0, new_tokens=24)
    tokens, _, (prefill, decode, _) = _run(model, "smartgen-no-head-start", "quest", small, small, new_tokens=24)
    assert tokens == expected
    assert prefill["evicted_blocks"] > 0 and decode["evicted_blocks"] > 0
    assert prefill["bytes"] <= small and decode["bytes"] <= small


def test_bytes_moved_for_a_held_prefix_equal_the_kv_of_the_part_the_decode_node_lacks(model):
    """Full transfer moves every prompt token it has to: with the decode node holding a prefix, exactly the rest."""
    _, metrics, (_, _, moved) = _run(model, "full", "quest", 0, 1 << 24)
    layout_token_bytes = 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 heads, head_dim 16, float32
    lacking = sum(m.prompt_tokens - m.held_tokens for m in metrics)
    assert [m.held_tokens for m in metrics] == [0, 64, 80, 48]
    assert moved["full"] == lacking * layout_token_bytes
