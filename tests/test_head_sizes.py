"""Every head size real checkpoints have runs every scheme and selector: 16 to 256, GQA and MHA, against HF.

The default run checks every shape against HF and under quant2, and every scheme and selector on the head sizes
that are not a multiple of 32 (48, 80, 112: the ones a 32-channel group once refused); `make test-slow` runs
every scheme and selector on every shape."""

import functools

import pytest
import torch
from tiny_models import hf_greedy
from transformers import LlamaConfig, Qwen2Config

from smartgen.engine.kv_quant import SERVING_QUANT, quant_unsupported
from smartgen.engine.policy import POLICIES, get_policy
from smartgen.runtime.models import model_from_config, model_info
from smartgen.runtime.pipeline import InprocPipeline

HEAD_SIZES = (16, 48, 64, 80, 96, 112, 128, 256)
NEW_TOKENS = 4
# (query heads, KV heads)
ATTENTION = {"gqa": (4, 2), "mha": (2, 2)}
SELECTORS = {
    "topk": {"budget": 0.3},
    "quest": {"budget": 0.3, "page_size": 4},
    "infinigen": {"budget": 0.3, "alpha": 2.0},
    "hata": {"budget": 0.3},  # untrained (random) hash weights: the lanes, not the recall, are under test
}
# a link slow against prefill, so the budgeted schemes leave most blocks to fetches and speculation
SLOW_LINK = dict(strategy="streaming", gbps=0.5, prefill_seconds_per_token=2e-4, transfer_seconds_per_token=1e-3)


def _config(head_dim: int, attention: str):
    """Llama with an explicit head size (hidden 64: tiny at any head size); Qwen2, whose head size is hidden / heads,
    for MHA shapes up to 128 (Qwen2 1.5B's 48 among them)."""
    q_heads, kv_heads = ATTENTION[attention]
    common = dict(
        vocab_size=97,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    if attention == "mha" and head_dim <= 128:
        return Qwen2Config(**common, hidden_size=q_heads * head_dim)
    return LlamaConfig(**common, hidden_size=64, head_dim=head_dim)


@functools.cache
def _model(head_dim: int, attention: str):
    return model_from_config(_config(head_dim, attention))


def _shapes(default: tuple[tuple[int, str], ...] | None = None) -> list:
    """Every (head size, attention) as a parameter; those outside `default` (None: all) marked slow."""
    return [
        pytest.param((d, a), id=f"d{d}-{a}", marks=() if default is None or (d, a) in default else pytest.mark.slow)
        for d in HEAD_SIZES
        for a in ATTENTION
    ]


EVERY_SHAPE = _shapes()
ODD_SHAPES = _shapes(((48, "gqa"), (80, "gqa"), (112, "mha")))


@pytest.fixture
def shaped(request):
    head_dim, attention = request.param
    model = _model(head_dim, attention)
    assert model_info(model).head_dim == head_dim
    return head_dim, model


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 97, (n,), generator=g) for n in (70, 41)]


def _run(model, scheme: str, selector: str = "dense", params: dict | None = None):
    policy = POLICIES[scheme]
    slow = dict(SLOW_LINK) if policy.proactive.value == "budget" else {}
    strategy = slow.pop("strategy", None)
    with InprocPipeline(
        model, get_policy(scheme, strategy=strategy), selector, params or {}, num_blocks=16, **slow
    ) as pipeline:
        return pipeline.generate(_prompts(), NEW_TOKENS, keep_logits=True)


@pytest.mark.parametrize("shaped", EVERY_SHAPE, indirect=True)
def test_full_transfer_equals_hf_generate(shaped):
    head_dim, model = shaped
    for prompt, result in zip(_prompts(), _run(model, "full")):
        tokens, logits = hf_greedy(model, prompt, NEW_TOKENS)
        assert result.tokens == tokens, head_dim
        for ours, theirs in zip(result.logits, logits[1:]):
            # sums over up to 256 channels of large random weights: a few 1e-4 of rounding
            torch.testing.assert_close(ours, theirs.float(), atol=5e-4, rtol=1e-3)


@pytest.mark.parametrize("shaped", ODD_SHAPES, indirect=True)
def test_every_scheme_runs_and_every_exact_one_gives_full_transfer_s_answer(shaped):
    head_dim, model = shaped
    full = _run(model, "full")
    for scheme, policy in POLICIES.items():
        if scheme in ("full", "quant2"):  # quant2: its own test
            continue
        results = _run(model, scheme)
        assert all(len(r.tokens) == NEW_TOKENS and not r.metrics.error for r in results), (head_dim, scheme)
        if policy.drop_remote:  # proactive-only attends to what was pushed: lossy by design
            continue
        assert [r.tokens for r in results] == [r.tokens for r in full], (head_dim, scheme)
        for a, b in zip(results, full):
            for x, y in zip(a.logits, b.logits):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shaped", EVERY_SHAPE, indirect=True)
def test_quantized_transfer_runs_at_every_head_size(shaped):
    """quant2 groups values by the largest divisor of the head size up to 32 (80 -> 20, 112 -> 28): lossy, close."""
    head_dim, model = shaped
    assert quant_unsupported(head_dim) is None
    assert head_dim % SERVING_QUANT.value_group(head_dim) == 0 and SERVING_QUANT.value_group(head_dim) >= 8
    full, quantized = _run(model, "full"), _run(model, "quant2")
    for a, b in zip(quantized, full):
        assert len(a.tokens) == NEW_TOKENS and not a.metrics.error
        # the prompts are shorter than the 128-token residual window: nothing is quantized, the answer is exact
        assert a.tokens == b.tokens, head_dim


@pytest.mark.parametrize("shaped", ODD_SHAPES, indirect=True)
@pytest.mark.parametrize("selector", SELECTORS)
def test_every_selector_s_answer_survives_the_lanes(shaped, selector):
    head_dim, model = shaped
    params = SELECTORS[selector]
    local = _run(model, "full", selector, params)
    split = _run(model, "smartgen", selector, params)
    for a, b in zip(local, split):
        assert a.tokens == b.tokens, (head_dim, selector)
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    assert any(r.metrics.remote_entries > 0 for r in split), "the test must exercise the remote lane"


@pytest.mark.parametrize("shaped", ODD_SHAPES, indirect=True)
def test_top_k_of_every_token_equals_dense(shaped):
    head_dim, model = shaped
    dense, topk = _run(model, "full"), _run(model, "full", "topk", {"budget": 1.0})
    assert [r.tokens for r in topk] == [r.tokens for r in dense], head_dim


def test_a_serving_pool_at_head_size_80_answers_every_scheme_as_full_transfer_does():
    """Real prefill and decode nodes over TCP (the pool sizes its quant2 staging at the handshake)."""
    from inproc_nodes import decode_node, prefill_node, tiny_parts

    from smartgen.roles.service import FinishEvent, GenerationParams

    parts = tiny_parts(config=_config(80, "gqa"))
    prefill = prefill_node(parts)
    decode = decode_node(parts, [prefill], scheme="smartgen")
    try:
        assert decode.engine.pool.geometry.quant_layer_bytes > 0
        prompt = torch.randint(3, 90, (150,), generator=torch.Generator().manual_seed(3)).tolist()
        answers = {}
        for scheme in POLICIES:
            handle = decode.scheduler.submit(prompt, GenerationParams(max_tokens=4, scheme=scheme))
            events = list(handle.events(timeout=60))
            assert isinstance(events[-1], FinishEvent) and events[-1].error is None, (scheme, events[-1])
            answers[scheme] = [e.token_id for e in events[:-1]]
        exact = [s for s, p in POLICIES.items() if not p.drop_remote and not p.quantize_bits]
        assert all(answers[s] == answers["full"] for s in exact), answers
        assert len(answers["quant2"]) == 4
    finally:
        decode.stop()
        prefill.stop()


def test_quant2_is_refused_with_its_reason_where_it_cannot_group_the_head_size_and_nothing_else_is():
    from smartgen.engine.kv_quant import QuantUnsupported
    from smartgen.engine.layout import KVLayout
    from smartgen.engine.policy import check_servable
    from smartgen.engine.pool import DecodePool

    assert "head size 74" in quant_unsupported(74)  # 2 x 37: no group between 8 and 32
    with pytest.raises(ValueError, match="scheme 'quant2' cannot run on this model: .*head size 74"):
        check_servable(get_policy("quant2"), head_dim=74)
    for scheme in POLICIES:
        if scheme != "quant2":
            check_servable(get_policy(scheme, strategy="streaming"), head_dim=74)
    pool = DecodePool(KVLayout(2, 1, 74, torch.float32, 4), num_slots=1, max_tokens=32)
    assert pool.geometry.quant_layer_bytes == 0 and pool.quant.numel() == 0
    with pytest.raises(QuantUnsupported, match="quant2 cannot run here"):
        pool.allocate(10, quantized=True)
    assert pool.num_free == 1
    pool.free(pool.allocate(10))  # every other scheme takes the slot


def test_a_pipeline_sizes_quant2_staging_only_for_quant2():
    model = _model(80, "gqa")
    with InprocPipeline(model, get_policy("full"), "dense", num_blocks=16) as pipeline:
        assert pipeline.decode_engine.pool.quant.numel() == 0
    with InprocPipeline(model, get_policy("quant2"), "dense", num_blocks=16) as pipeline:
        assert pipeline.decode_engine.pool.quant.numel() > 0
