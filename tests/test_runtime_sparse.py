"""Sparse selectors in the runtime: lanes never change the numbers, top-k at full budget is dense, metadata is exact."""

import os
import sys
import threading

import pytest
import torch
from tiny_models import tiny_config
from transformers import DynamicCache

from smartgen.engine.policy import get_policy
from smartgen.runtime.cache_kwarg import with_cache
from smartgen.runtime.emulation import Emulation
from smartgen.runtime.models import model_from_config, model_info
from smartgen.runtime.pipeline import InprocPipeline
from smartgen.runtime.prefill import PrefillRunner, capture_qk, infinigen_skewing
from smartgen.selectors import make_selector
from smartgen.selectors.quest import dequantize_bounds

NEW_TOKENS = 6


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 97, (n,), generator=g) for n in (70, 45)]


@pytest.fixture(scope="module")
def llama():
    return model_from_config(tiny_config("llama"))


def _run(model, policy: str, selector: str, params: dict, **kwargs):
    with InprocPipeline(
        model, get_policy(policy, strategy=kwargs.pop("strategy", None)), selector, params, num_blocks=16, **kwargs
    ) as p:
        return p.generate(_prompts(), NEW_TOKENS, keep_logits=True)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "phi3"])
def test_exact_topk_with_every_token_equals_dense(family):
    model = model_from_config(tiny_config(family))
    dense = _run(model, "full", "dense", {})
    topk = _run(model, "full", "topk", {"budget": 1.0})
    assert [r.tokens for r in topk] == [r.tokens for r in dense]
    for a, b in zip(topk, dense):
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "selector,params",
    [
        ("topk", {"budget": 0.3}),
        ("quest", {"budget": 0.3, "page_size": 4}),
        ("infinigen", {"budget": 0.3, "alpha": 2.0}),
        # rows of unequal length per head (adaptive) and budgets that differ by layer (pyramid)
        ("quest", {"budget": 0.3, "page_size": 4, "head_split": "adaptive", "layer_split": "pyramid"}),
        ("topk", {"budget": 0.3, "head_split": "adaptive", "floor": 0.0}),
    ],
)
@pytest.mark.parametrize("policy", ["partial", "partial+profile+parallel", "smartgen"])
def test_lanes_never_change_the_numbers(llama, selector, params, policy):
    local = _run(llama, "full", selector, params)
    # budgeted policies without a profile: the streaming proactive set
    # a link slow against prefill, so K_r leaves most blocks to fetches and speculation
    split = _run(
        llama,
        policy,
        selector,
        params,
        strategy="streaming" if policy != "partial" else None,
        gbps=0.5,
        prefill_seconds_per_token=2e-4,
        transfer_seconds_per_token=1e-3,
    )
    for a, b in zip(local, split):
        assert a.tokens == b.tokens
        # remote-first rows sum in another order than all-local ones: equal up to float rounding
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    # smartgen's forecast fetches step one's picks before the step (prefetched), so its steps may meet none remote
    fetched = [r.metrics.remote_entries + r.metrics.prefetched_entries + r.metrics.forecast_entries for r in split]
    assert any(n > 0 for n in fetched), "the test must exercise the remote lane"


def test_infinigen_with_offline_skewing_runs_and_splits_identically(llama):
    skew = infinigen_skewing(llama, torch.randint(3, 97, (64,), generator=torch.Generator().manual_seed(5)))
    assert sorted(skew) == [2, 3]
    params = {"budget": 0.3, "skew": skew}
    local = _run(llama, "full", "infinigen", params)
    split = _run(llama, "partial", "infinigen", params)
    assert [r.tokens for r in local] == [r.tokens for r in split]


def test_sparse_selection_changes_little_on_a_tiny_model(llama):
    dense = _run(llama, "full", "dense", {})
    quest = _run(llama, "full", "quest", {"budget": 0.5, "page_size": 4})
    # not equal in general (it is sparse), but the first token comes from the same dense prefill
    assert [r.tokens[0] for r in quest] == [r.tokens[0] for r in dense]


@pytest.mark.parametrize("selector", ["quest", "topk", "infinigen"])
def test_metadata_from_prefill_equals_metadata_from_the_full_cache(llama, selector):
    info = model_info(llama)
    prompt = _prompts()[0]
    params = {"skew": infinigen_skewing(llama, prompt)} if selector == "infinigen" else {}
    chosen = make_selector(selector, info, **params)
    output = PrefillRunner(llama, chosen).run(prompt)
    # recompute from HF's own cache after a plain forward (post-RoPE keys)
    cache = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(input_ids=prompt[None], **with_cache(llama, cache), use_cache=True)
    queries, _ = capture_qk(llama, prompt)
    for layer in (2, 3):
        keys = cache.layers[layer].keys[0]  # [H, n, d]
        if selector == "quest":
            page_max, page_min = [], []
            for start in range(0, prompt.numel(), chosen.page_size):
                page = keys[:, start : start + chosen.page_size]
                page_max.append(page.amax(dim=1))
                page_min.append(page.amin(dim=1))
            shipped_max, shipped_min = dequantize_bounds(output.metadata[layer])  # 8-bit, rounded outward
            assert (shipped_max >= torch.stack(page_max, 1).float()).all()
            assert (shipped_min <= torch.stack(page_min, 1).float()).all()
            step = output.metadata[layer]["step"][:, None]
            torch.testing.assert_close(shipped_max, torch.stack(page_max, 1).float(), atol=float(step.max()), rtol=0)
            torch.testing.assert_close(shipped_min, torch.stack(page_min, 1).float(), atol=float(step.max()), rtol=0)
        elif selector == "topk":
            torch.testing.assert_close(output.metadata[layer]["keys"], keys)
        else:
            meta = output.metadata[layer]
            skewed = keys.float() @ meta["skew"]  # [H, n, d]
            expected = skewed.gather(2, meta["columns"][:, None, :].expand(-1, keys.shape[1], -1))
            torch.testing.assert_close(meta["partial_keys"].float(), expected, atol=1e-5, rtol=1e-5)
    assert output.metadata[0] == {} and output.metadata[1] == {}


def test_query_proactive_set_keeps_the_numbers_and_is_used(llama, monkeypatch):
    """SmartGen with the "query" proactive set on a real model: same tokens as all-local, and the prefill worker
    really handed the engine the last query's attention (it is only computed for requests that use it)."""
    from smartgen.engine.prefill import PrefillEngine

    seen = []
    real = PrefillEngine.prefill_layer

    def spy(self, request_id, layer, k, v, token_scores=None):
        seen.append((layer, token_scores is not None))
        return real(self, request_id, layer, k, v, token_scores)

    monkeypatch.setattr(PrefillEngine, "prefill_layer", spy)
    params = {"budget": 0.3, "page_size": 4}
    local = _run(llama, "full", "quest", params)
    assert not any(scored for _, scored in seen), "no scores for a request that does not use them"
    seen.clear()
    split = _run(
        llama,
        "smartgen",
        "quest",
        params,
        strategy="query",
        gbps=0.5,
        prefill_seconds_per_token=2e-4,
        transfer_seconds_per_token=1e-3,
    )
    assert [r.tokens for r in split] == [r.tokens for r in local]
    assert {layer for layer, scored in seen if scored} == {2, 3}  # every layer past the always-sent ones


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling policies per thread are Linux's")
def test_the_prefetch_worker_runs_batched_whoever_starts_it(llama, monkeypatch):
    """The step thread starts the runner's worker (on its first prefetch); the worker must not preempt that step as
    it wakes, so it batches itself (`thread_priority.batch_this_thread`) whatever policy it inherited."""
    monkeypatch.delenv("SMARTGEN_BACKGROUND_NICE", raising=False)
    with InprocPipeline(llama, get_policy("partial"), "quest", {"budget": 0.3, "page_size": 4}, num_blocks=16) as p:
        policy = p.decode_runner.worker.submit(lambda: os.sched_getscheduler(threading.get_native_id())).result()
    assert policy == os.SCHED_BATCH and os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


@pytest.mark.parametrize("floor", [False, True])
def test_every_decode_step_is_counted_by_batch_size_with_its_parts(llama, floor):
    """The decode node's step breakdown (`PathCounters.add_step`, the bench's step table): each step's wall time,
    its thread's CPU, the emulated compute it slept and its waits for fetch replies, by the batch it ran. With a
    floor, every step's CPU and sleep together reach the floor of all its layers."""
    layers = llama.config.num_hidden_layers
    with InprocPipeline(llama, get_policy("partial"), "quest", {"budget": 0.3, "page_size": 4}, num_blocks=16) as p:
        p.decode_runner.emulation = Emulation(floor_s=0.002) if floor else Emulation(added_s=0.002)
        results = p.generate(_prompts(), NEW_TOKENS)
        steps = p.decode_engine.counters.snapshot()["steps"]
    assert set(steps) <= {"1", "2"} and steps
    assert sum(parts["steps"] for parts in steps.values()) >= NEW_TOKENS - 1
    assert sum(int(b) * parts["steps"] for b, parts in steps.items()) == sum(len(r.tokens) - 1 for r in results)
    for parts in steps.values():
        if floor:  # each step's own CPU counts toward its floor (sleeps overshoot by microseconds at most)
            assert parts["emulated_s"] + parts["cpu_s"] >= parts["steps"] * layers * 0.002 * 0.999
        else:
            assert parts["emulated_s"] >= parts["steps"] * layers * 0.002  # every layer of every step slept
        assert parts["wall_s"] >= parts["cpu_s"] > 0 and parts["wall_s"] >= parts["emulated_s"] + parts["wait_s"]
    assert sum(parts["wait_s"] for parts in steps.values()) > 0  # partial fetches layers >= 2 at every step
    assert all(parts["preempted"] >= 0 and parts["preempted"] == int(parts["preempted"]) for parts in steps.values())
