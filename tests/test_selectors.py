"""Sparse selectors (exact top-k, Quest, InfiniGen, HATA): index contract, metadata, bounds, and InfiniGen's query path."""

import pytest
import torch
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from smartgen.runtime.cache_kwarg import cache_kwarg, with_cache
from smartgen.selectors import make_selector
from smartgen.selectors.base import ModelInfo, PrefillLayer, StepQuery, budget_tokens
from smartgen.selectors.hata import HATASelector
from smartgen.selectors.infinigen import InfiniGenSelector, compute_skewing, rope_from_model
from smartgen.selectors.quest import QuestSelector, page_bounds, page_upper_bounds
from smartgen.selectors.topk import ExactTopKSelector

HQ, H, D_HEAD, HIDDEN, LAYERS = 4, 2, 16, 64, 4
INFO = ModelInfo(num_layers=LAYERS, num_q_heads=HQ, num_kv_heads=H, head_dim=D_HEAD, hidden_size=HIDDEN)


# ---- a tiny real Llama, and its attention inputs / post-RoPE q, k captured by pre-hooks ----


@pytest.fixture(scope="module")
def tiny():
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HQ,
        num_key_value_heads=H,
        head_dim=D_HEAD,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    info = ModelInfo(LAYERS, HQ, H, D_HEAD, HIDDEN, model=model, rope=rope_from_model(model))
    return model, info


def run_captured(model, ids, cache=None):
    """One forward pass; per layer the attention input [T, D] and HF's own post-RoPE q [Hq, T, d], k [H, T, d]."""
    seen = {}

    def hook(layer):
        def fn(module, args, kwargs):
            x = kwargs["hidden_states"]  # [1, T, D]
            cos, sin = kwargs["position_embeddings"]
            shape = (*x.shape[:-1], -1, D_HEAD)
            q = module.q_proj(x).view(shape).transpose(1, 2)
            k = module.k_proj(x).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            seen[layer] = (x[0], q[0], k[0])

        return fn

    attns = [blk.self_attn for blk in model.model.layers]
    handles = [a.register_forward_pre_hook(hook(i), with_kwargs=True) for i, a in enumerate(attns)]
    try:
        with torch.no_grad():
            out = model(ids, **with_cache(model, cache), use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return seen, getattr(out, cache_kwarg(model))  # the output names it as the forward does


def prompt(n, seed):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


# ---- the index contract, shared by every selector ----


def random_prefill(layer, n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return PrefillLayer(
        layer=layer,
        query=torch.randn(HQ, n, D_HEAD, generator=g).to(dtype),
        key=torch.randn(H, n, D_HEAD, generator=g).to(dtype),
        hidden=torch.randn(n, HIDDEN, generator=g).to(dtype),
    )


def random_step(layer, lengths, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 1000)
    return StepQuery(
        layer=layer,
        query=torch.randn(len(lengths), HQ, D_HEAD, generator=g).to(dtype),
        hidden=torch.randn(len(lengths), HIDDEN, generator=g),
        positions=torch.tensor(lengths, dtype=torch.int64),
        prompt_lengths=list(lengths),
    )


def max_tokens(selector, n):
    if isinstance(selector, QuestSelector):  # the last page goes even when it alone exceeds the budget
        return max(budget_tokens(selector.budget, n), n - (n - 1) // selector.page_size * selector.page_size)
    return budget_tokens(selector.budget, n)


def check_index(index, selector, lengths):
    assert index.dtype == torch.int64 and index.dim() == 2
    assert index.shape[0] == len(lengths) * H
    for r in range(index.shape[0]):
        row, n = index[r], lengths[r // H]
        valid = row >= 0
        # entries first, -1 padding only at the tail
        assert not (valid[1:] & ~valid[:-1]).any()
        entries = row[valid]
        assert (row[~valid] == -1).all()
        assert 1 <= entries.numel() <= max_tokens(selector, n)
        assert entries.max() < n
        assert entries.unique().numel() == entries.numel()


def make(name, tiny, **params):
    return make_selector(name, tiny[1] if name == "infinigen" else INFO, **params)


SELECTOR_PARAMS = [
    ("topk", {}),
    ("topk", {"budget": 7}),
    ("quest", {}),
    ("quest", {"budget": 0.3, "page_size": 8}),
    ("quest", {"budget": 3}),
    ("infinigen", {}),
    ("infinigen", {"budget": 0.5, "alpha": 1e9}),
    ("infinigen", {"budget": 0.3, "speculate": False}),
    ("hata", {}),
    ("hata", {"budget": 7, "rbit": 16, "use_norm": False}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,params", SELECTOR_PARAMS)
def test_index_contract_on_a_padded_batch(tiny, name, params, dtype):
    selector = make(name, tiny, **params)
    lengths = [37, 100]
    metadata = [selector.build_metadata(random_prefill(2, n, seed=n, dtype=dtype)) for n in lengths]
    index = selector.select(random_step(2, lengths, seed=5, dtype=dtype), metadata)
    check_index(index, selector, lengths)


@pytest.mark.parametrize("name,params", SELECTOR_PARAMS)
def test_a_request_selects_the_same_alone_or_batched(tiny, name, params):
    selector = make(name, tiny, **params)
    lengths = [100, 37]
    metadata = [selector.build_metadata(random_prefill(3, n, seed=n)) for n in lengths]
    step = random_step(3, lengths, seed=9)
    batched = selector.select(step, metadata)
    alone_step = StepQuery(
        3,
        None if step.query is None else step.query[1:],
        None if step.hidden is None else step.hidden[1:],
        step.positions[1:],
        [37],
    )
    alone = selector.select(alone_step, metadata[1:])
    width = alone.shape[1]
    assert torch.equal(batched[H:, :width], alone)
    assert (batched[H:, width:] == -1).all()


@pytest.mark.parametrize("name", ["topk", "quest", "infinigen", "hata"])
def test_full_budget_returns_every_prompt_token(tiny, name):
    params = {"alpha": float("inf")} if name == "infinigen" else {}
    selector = make(name, tiny, budget=1.0, **params)
    lengths = [45, 19]
    metadata = [selector.build_metadata(random_prefill(2, n, seed=n)) for n in lengths]
    index = selector.select(random_step(2, lengths, seed=3), metadata)
    for r in range(index.shape[0]):
        n = lengths[r // H]
        assert torch.equal(index[r, :n], torch.arange(n))


def test_one_dominant_token_is_picked_by_every_selector():
    n, hot = 100, 53
    g = torch.Generator().manual_seed(0)
    base = torch.randn(H, D_HEAD, generator=g)
    query = (base.repeat_interleave(HQ // H, dim=0) + 0.05 * torch.randn(HQ, D_HEAD, generator=g))[None]  # [1, Hq, d]
    keys = 0.1 * torch.randn(H, n, D_HEAD, generator=g)
    keys[:, hot] = 4 * base  # logit ≈ 4·|base|²/4 ≈ 16 against ≈ 0 for every other token
    prefill = PrefillLayer(2, torch.randn(HQ, n, D_HEAD, generator=g), keys, None)
    step = StepQuery(2, query, None, torch.tensor([n]), [n])
    for selector in (ExactTopKSelector(INFO, budget=5), QuestSelector(INFO, budget=48), HATASelector(INFO, budget=5)):
        index = selector.select(step, [selector.build_metadata(prefill)])
        assert all(hot in row.tolist() for row in index)
    # with no skew and every column kept, InfiniGen scores exactly; only `hot` is within alpha of the max
    infinigen = InfiniGenSelector(INFO, budget=0.2, partial_ratio=1.0, alpha=4.0)
    index = infinigen.select(step, [infinigen.build_metadata(prefill)])
    assert index.tolist() == [[hot]] * H


# ---- Quest ----


def test_quest_metadata_matches_a_page_loop_over_the_full_cache():
    keys = torch.randn(H, 70, D_HEAD, dtype=torch.float64).to(torch.bfloat16)
    selector = QuestSelector(INFO, page_size=16, bound_bits=16)
    meta = selector.build_metadata(PrefillLayer(2, torch.randn(HQ, 70, D_HEAD), keys, None))
    assert meta["page_max"].shape == meta["page_min"].shape == (H, 5, D_HEAD)
    assert meta["page_max"].dtype == torch.bfloat16
    for p, start in enumerate(range(0, 70, 16)):
        page = keys[:, start : start + 16]
        assert torch.equal(meta["page_max"][:, p], page.amax(dim=1))
        assert torch.equal(meta["page_min"][:, p], page.amin(dim=1))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 90), st.integers(1, 8), st.floats(0.01, 100.0), st.integers(0, 2**16))
def test_quest_8bit_bounds_contain_every_page_and_take_half_the_bytes(n, page_size, scale, seed):
    from smartgen.selectors.quest import dequantize_bounds

    generator = torch.Generator().manual_seed(seed)
    keys = (torch.randn(H, n, D_HEAD, generator=generator) * scale).to(torch.bfloat16)
    prefill = PrefillLayer(2, torch.randn(HQ, n, D_HEAD), keys, None)
    exact = QuestSelector(INFO, page_size=page_size, bound_bits=16).build_metadata(prefill)
    coded = QuestSelector(INFO, page_size=page_size, bound_bits=8).build_metadata(prefill)
    page_max, page_min = dequantize_bounds(coded)
    assert (page_max >= exact["page_max"].float()).all() and (page_min <= exact["page_min"].float()).all()
    low, step = coded["low"][:, None], coded["step"][:, None]
    slack = step + 1e-5 * (low.abs() + (low + 255 * step).abs()) + 1e-30  # a grid step and the float margin
    assert (page_max - exact["page_max"].float() <= slack).all()  # looser by at most that
    assert (exact["page_min"].float() - page_min <= slack).all()
    pages = -(-n // page_size)
    coded_bytes = sum(t.numel() * t.element_size() for t in coded.values())
    assert coded_bytes == 2 * H * pages * D_HEAD + 2 * 4 * H * D_HEAD  # two codes per entry, a float grid per channel


def test_quest_selects_from_either_form_of_its_bounds():
    """A decode node's Quest reads 8-bit or 16-bit metadata alike, whichever its prefill node made; with bounds
    far apart on a coarse grid, both forms pick the same pages."""
    keys = torch.zeros(H, 64, D_HEAD)
    for page in range(8):
        keys[:, page * 8 : page * 8 + 8] = float(page)  # page p's keys are all p: its bound ranks it
    query = torch.ones(1, HQ, D_HEAD)
    prefill = PrefillLayer(2, torch.randn(HQ, 64, D_HEAD), keys, None)
    step = StepQuery(2, query, None, torch.tensor([64]), [64])
    picks = [
        QuestSelector(INFO, budget=0.25, page_size=8, bound_bits=bits).select(
            step, [QuestSelector(INFO, page_size=8, bound_bits=bits).build_metadata(prefill)]
        )
        for bits in (8, 16)
    ]
    assert torch.equal(picks[0], picks[1])
    assert set(picks[0][0].tolist()) == set(range(48, 64))  # 16 tokens: page 6 and the last (7)


def test_quest_refuses_bound_bits_it_cannot_ship():
    with pytest.raises(ValueError, match="bound_bits"):
        QuestSelector(INFO, bound_bits=4)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 90), page_size=st.integers(1, 20), scale=st.floats(0.01, 100), seed=st.integers(0, 2**16))
def test_quest_bound_is_at_least_the_true_max_over_each_page(n, page_size, scale, seed):
    g = torch.Generator().manual_seed(seed)
    keys = scale * torch.randn(H, n, D_HEAD, generator=g)
    query = torch.randn(HQ, D_HEAD, generator=g)
    bounds = page_upper_bounds(query, *page_bounds(keys, page_size))  # [Hq, P]
    true = torch.einsum("hgd,hnd->hgn", query.view(H, -1, D_HEAD).double(), keys.double()).reshape(HQ, n)
    # float32 rounding of the bound is relative to Σ|q_d·k_d|, not to the (possibly cancelling) sum
    slack = 1e-5 * query.abs().sum(-1).double() * keys.abs().max().double()  # [Hq]
    for p, start in enumerate(range(0, n, page_size)):
        page_true = true[:, start : start + page_size].amax(dim=1)
        assert (bounds[:, p].double() >= page_true - slack).all()


def test_quest_always_takes_the_last_partial_page():
    selector = QuestSelector(INFO, budget=32, page_size=16)  # 2 pages: the last and one more
    meta = selector.build_metadata(random_prefill(2, 100, seed=1))
    index = selector.select(random_step(2, [100], seed=2), [meta])
    assert index.shape == (H, 16 + 4)
    assert (index[:, 16:] == torch.arange(96, 100)).all()


# ---- exact top-k ----


def test_topk_matches_a_brute_force_oracle():
    selector = ExactTopKSelector(INFO, budget=10)
    prefill = random_prefill(2, 60, seed=4)
    step = random_step(2, [60], seed=4)
    index = selector.select(step, [selector.build_metadata(prefill)])
    for h in range(H):
        probs = [((step.query[0, j] @ prefill.key[h].T) / D_HEAD**0.5).softmax(-1) for j in range(h * 2, h * 2 + 2)]
        expect = torch.maximum(*probs).topk(10).indices.sort().values
        assert torch.equal(index[h], expect)


# ---- InfiniGen ----


@pytest.fixture(scope="module")
def warmup(tiny):
    model, info = tiny
    seen, _ = run_captured(model, prompt(64, seed=7))
    skew = compute_skewing(info, {i: q for i, (_, q, _) in seen.items()}, {i: k for i, (_, _, k) in seen.items()})
    return seen, skew


def test_skewing_is_orthogonal_and_keeps_q_dot_k(tiny, warmup):
    seen, skew = warmup
    for layer, (_, q, k) in seen.items():
        a = skew[layer]
        assert a.shape == (H, D_HEAD, D_HEAD)
        torch.testing.assert_close(a @ a.transpose(1, 2), torch.eye(D_HEAD).expand(H, -1, -1), atol=1e-5, rtol=0)
        q = q.reshape(H, HQ // H, -1, D_HEAD)
        plain = q @ k[:, None].transpose(-1, -2)
        skewed = (q @ a[:, None]) @ (k @ a)[:, None].transpose(-1, -2)
        torch.testing.assert_close(skewed, plain, atol=1e-4, rtol=1e-4)


def test_skewing_concentrates_query_energy_in_few_columns(tiny, warmup):
    seen, skew = warmup
    for layer in range(2, LAYERS):
        q = seen[layer][1].reshape(H, -1, D_HEAD)  # [H, G·n, d]

        # Ky Fan: the top eigenvectors of QᵀQ hold the most energy any d' orthonormal columns can,
        # so the skewed query's best d' columns beat the plain query's best d' columns
        def top(x):
            return x.pow(2).sum(dim=1).sort(dim=-1, descending=True).values[:, : D_HEAD // 4].sum(-1)

        assert (top(q @ skew[layer]) >= top(q) * (1 - 1e-5)).all()


def test_infinigen_metadata_equals_a_gather_of_the_skewed_full_cache(tiny, warmup):
    model, info = tiny
    _, skew = warmup
    selector = InfiniGenSelector(info, skew=skew)
    seen, cache = run_captured(model, prompt(50, seed=1))
    for layer in range(2, LAYERS):
        hidden, q, k = seen[layer]
        meta = selector.build_metadata(PrefillLayer(layer, q, k, hidden))
        d_part = max(1, int(D_HEAD * 0.2))
        assert meta["columns"].shape == (H, d_part) and meta["columns"].dtype == torch.int64
        full = cache.layers[layer].keys[0] @ skew[layer]  # [H, n, d] from the model's own KV cache
        expect = torch.stack([full[h][:, meta["columns"][h]] for h in range(H)])
        torch.testing.assert_close(meta["partial_keys"], expect, atol=1e-5, rtol=1e-5)
        energy = (q.reshape(H, -1, D_HEAD) @ skew[layer]).abs().sum(dim=1)
        assert torch.equal(meta["columns"], energy.topk(d_part).indices.sort().values)
    assert selector.build_metadata(PrefillLayer(1, seen[1][1], seen[1][2], None)) == {}


def test_speculated_query_equals_the_real_query_on_the_same_hidden_state(tiny):
    model, info = tiny
    seen, _ = run_captured(model, prompt(24, seed=3))
    for use_model_rope in (True, False):
        selector = InfiniGenSelector(info if use_model_rope else ModelInfo(LAYERS, HQ, H, D_HEAD, HIDDEN, model=model))
        for layer in range(LAYERS):
            hidden, q, _ = seen[layer]
            with torch.no_grad():
                spec = selector.query_from_hidden(layer, hidden, torch.arange(24))  # [T, Hq, d]
            torch.testing.assert_close(spec, q.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_lookahead_decode_step_on_the_real_model(tiny, warmup):
    model, info = tiny
    _, skew = warmup
    lengths = [40, 29]
    # full columns and an unbounded alpha: speculating from a layer's *own* input must then
    # give the exact top-k of the summed per-head probabilities
    exact = InfiniGenSelector(info, budget=0.25, partial_ratio=1.0, alpha=float("inf"), skew=skew)
    lookahead = InfiniGenSelector(info, skew=skew)
    metas = {s: {i: [] for i in range(2, LAYERS)} for s in (exact, lookahead)}
    decode = []
    for b, n in enumerate(lengths):
        ids = prompt(n + 1, seed=20 + b)
        seen, cache = run_captured(model, ids[:, :n])
        for layer in range(2, LAYERS):
            hidden, q, k = seen[layer]
            for s in metas:
                metas[s][layer].append(s.build_metadata(PrefillLayer(layer, q, k, hidden)))
        step_seen, cache = run_captured(model, ids[:, n:], cache=cache)
        decode.append((step_seen, cache))
    positions = torch.tensor(lengths)
    for layer in range(2, LAYERS):
        prev_hidden = torch.stack([s[layer - 1][0][0] for s, _ in decode])  # [B, D] layer l-1's input
        step = StepQuery(layer, None, prev_hidden, positions, lengths)
        with torch.no_grad():
            check_index(lookahead.select(step, metas[lookahead][layer]), lookahead, lengths)
            own_hidden = torch.stack([s[layer][0][0] for s, _ in decode])
            index = exact.select(StepQuery(layer, None, own_hidden, positions, lengths), metas[exact][layer])
        for b, (step_seen, cache) in enumerate(decode):
            q = step_seen[layer][1][:, 0]  # [Hq, d] real decode query
            keys = cache.layers[layer].keys[0][:, : lengths[b]]  # prompt keys [H, n, d]
            probs = (torch.einsum("hgd,hnd->hgn", q.view(H, -1, D_HEAD), keys) * D_HEAD**-0.5).softmax(-1).sum(1)
            expect = probs.topk(budget_tokens(0.25, lengths[b])).indices.sort().values
            got = index[b * H : (b + 1) * H]
            assert torch.equal(got[:, : expect.shape[1]], expect)
            assert (got[:, expect.shape[1] :] == -1).all()


def test_infinigen_without_speculation_selects_with_the_layers_own_query(tiny):
    _, info = tiny
    plain = InfiniGenSelector(info, budget=0.2, speculate=False)
    assert not plain.lookahead and InfiniGenSelector(info).lookahead
    lengths = [60]
    metadata = [plain.build_metadata(random_prefill(2, 60, seed=1))]
    step = random_step(2, lengths, seed=2)  # carries a (random) hidden state too: it must be ignored
    without_hidden = StepQuery(2, step.query, None, step.positions, lengths)
    assert torch.equal(plain.select(step, metadata), plain.select(without_hidden, metadata))


def test_infinigen_without_skewing_ignores_the_skew(tiny, warmup):
    """skewing=False is InfiniGen's ablation: A = I, so the partial keys are raw key columns."""
    model, info = tiny
    _, skew = warmup
    plain = InfiniGenSelector(info, skew=skew, skewing=False)
    seen, _ = run_captured(model, prompt(50, seed=1))
    hidden, q, k = seen[2]
    meta = plain.build_metadata(PrefillLayer(2, q, k, hidden))
    assert torch.equal(meta["skew"], torch.eye(D_HEAD).expand(H, -1, -1))
    expect = torch.stack([k[h][:, meta["columns"][h]] for h in range(H)])
    torch.testing.assert_close(meta["partial_keys"], expect)
    skewed = InfiniGenSelector(info, skew=skew).build_metadata(PrefillLayer(2, q, k, hidden))
    assert not torch.equal(skewed["partial_keys"], meta["partial_keys"])


def test_quest_gqa_max_ranks_pages_by_each_heads_softmaxed_bound():
    from smartgen.selectors.base import ModelInfo
    from smartgen.selectors.quest import QuestSelector, page_bounds, page_upper_bounds

    info = ModelInfo(num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32)
    g = torch.Generator().manual_seed(4)
    keys, query = torch.randn(2, 70, 8, generator=g), torch.randn(4, 8, generator=g)
    query[1] *= 20  # head 1's bounds are on a larger scale than head 0's: "bound" follows head 1 alone
    for gqa in ("bound", "max"):
        selector = QuestSelector(info, budget=20, page_size=4, gqa=gqa)
        meta = selector.build_metadata(PrefillLayer(2, torch.randn(4, 70, 8), keys, None))
        index = selector.select(StepQuery(2, query[None], None, torch.tensor([70]), [70]), [meta])
        page_max, page_min = page_bounds(keys, 4)
        bounds = page_upper_bounds(query, page_max[:, :-1], page_min[:, :-1]).view(2, 2, -1)
        score = bounds.amax(dim=1) if gqa == "bound" else (bounds * 8**-0.5).softmax(-1).amax(dim=1)
        pages = score.topk(selector.page_budget(70) - 1).indices.sort().values  # + the last page, 17
        for h in range(2):
            assert index[h][index[h] >= 0].div(4, rounding_mode="floor").unique().tolist() == [*pages[h].tolist(), 17]


@settings(max_examples=40, deadline=None)
@given(st.integers(20, 120), st.sampled_from([0.1, 0.2, 0.5]), st.sampled_from([0.25, 0.5, 1.0]), st.booleans())
def test_quest_ranks_once_for_its_pick_and_the_next_pages(n, budget, factor, ties):
    """`select_with_next` cuts one ranking at two budgets: the pick equals `select`'s, and the pick with what
    comes next is the widened selector's own `select`, the next pages' tokens in rank order (page by page, each
    page's tokens ascending), none of the pick's among them, even where pages tie (all-equal keys give equal
    bounds)."""
    generator = torch.Generator().manual_seed(n)
    keys = torch.ones(H, n, D_HEAD) if ties else torch.randn(H, n, D_HEAD, generator=generator)
    query = torch.randn(2, HQ, D_HEAD, generator=generator)
    quest = QuestSelector(INFO, budget=budget, page_size=4)
    wide = quest.widened(factor)
    assert isinstance(wide, QuestSelector)
    metadata = [quest.build_metadata(PrefillLayer(2, torch.randn(HQ, n, D_HEAD), keys, None))] * 2
    step = StepQuery(2, query, None, torch.tensor([n, n]), [n, n])
    picked, following = quest.select_with_next(step, metadata, wide)
    assert torch.equal(picked, quest.select(step, metadata))
    for row, next_row, wide_row in zip(picked.tolist(), following.tolist(), wide.select(step, metadata).tolist()):
        row, next_row, wide_row = (set(r) - {-1} for r in (row, next_row, wide_row))
        assert row <= wide_row
        assert next_row == wide_row or (next_row == wide_row - row and not next_row & row)
    pages = quest.page_budget(n) - 1, wide.page_budget(n) - 1  # ranked pages each keeps, the last page aside
    if -(-n // 4) > wide.page_budget(n):  # the wide pick is not every token: the next pages, likeliest first
        ranked = quest._rank_pages(query, metadata, [-(-n // 4)] * 2)  # [B, H, P-1], best first
        band = ranked[:, :, pages[0] : pages[1]].reshape(2 * H, -1)
        expected = (band[:, :, None] * 4 + torch.arange(4)).flatten(1)
        assert torch.equal(following, expected)


def test_the_contract_says_what_a_selector_needs_before_it_runs():
    from smartgen.selectors import SELECTORS, selector_class, selector_kind

    kinds = {name: selector_class(name) for name in SELECTORS}
    assert [n for n, k in kinds.items() if k.needs_training] == ["hata"]
    assert [n for n, k in kinds.items() if k.needs_warmup] == ["infinigen"]
    assert [n for n, k in kinds.items() if not k.sparse] == ["dense"]
    assert {n: k.learned_param for n, k in kinds.items() if k.learned_param} == {"hata": "weights", "infinigen": "skew"}
    assert selector_kind("hata") is kinds["hata"]


def test_nothing_outside_the_selectors_tests_a_selector_s_name():
    """What a selector needs is the contract's to say (needs_training, needs_warmup, sparse), not a name's."""
    import ast
    from pathlib import Path

    from smartgen.selectors import SELECTORS

    root = Path(__file__).resolve().parent.parent
    found = []
    for folder in ("smartgen", "cli", "tui", "store"):
        for path in (root / folder).rglob("*.py"):
            if "selectors" in path.relative_to(root).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                names = [s.value for s in sides if isinstance(s, ast.Constant) and s.value in SELECTORS]
                if names and any("selector" in ast.unparse(s) for s in sides):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(3, 150), min_size=1, max_size=6),
    st.sampled_from([8, 16]),
    st.sampled_from(["max", "bound"]),
    st.booleans(),
)
@example([85, 130], 16, "max", True)  # once failed CI: a tie broken by rounding, before the query was whole numbers
def test_quest_ranks_a_batch_in_one_pass_as_each_request_alone(lengths, bits, gqa, ties):
    """The even split ranks every request's pages together (padded to the most pages): each request's pick and
    wide pick are what it selects alone, whatever the others' lengths, short prompts (every token) included. With
    `ties` every page scores the same and ties go by page; the query is then whole numbers, so every page's score is
    exact: with fractions, a product's rounding depends on where its column falls in the kernel's blocks, and that
    differs between a batch padded to the most pages and one request alone."""
    generator = torch.Generator().manual_seed(sum(lengths))
    quest = QuestSelector(INFO, budget=0.2, page_size=4, bound_bits=bits, gqa=gqa)
    wide = quest.widened(0.5)
    assert isinstance(wide, QuestSelector)
    metadata = []
    for n in lengths:
        keys = torch.ones(H, n, D_HEAD) if ties else torch.randn(H, n, D_HEAD, generator=generator)
        metadata.append(quest.build_metadata(PrefillLayer(2, torch.randn(HQ, n, D_HEAD), keys, None)))
    query = torch.randn(len(lengths), HQ, D_HEAD, generator=generator)
    if ties:
        query = query.mul(4).round()
    step = StepQuery(2, query, None, torch.tensor(lengths), lengths)
    picked, widened = quest.select_with_next(step, metadata, wide)
    for b, n in enumerate(lengths):
        alone = StepQuery(2, query[b : b + 1], None, torch.tensor([n]), [n])
        own, own_wide = quest.select_with_next(alone, metadata[b : b + 1], wide)
        rows = slice(b * H, (b + 1) * H)
        for batched, single in ((picked[rows], own), (widened[rows], own_wide)):
            assert torch.equal(batched[:, : single.shape[1]], single)
            assert (batched[:, single.shape[1] :] == -1).all()


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 90), page_size=st.integers(1, 20), scale=st.floats(0.01, 100), seed=st.integers(0, 2**16))
def test_quest_bounds_from_codes_match_the_elementwise_rule_on_the_dequantized_bounds(n, page_size, scale, seed):
    """`upper_bounds` scores 8-bit codes by two batched products; it must give the elementwise max(q·max, q·min)
    of the dequantized bounds (Quest's rule) up to float32 rounding, and stay an upper bound of each page's q·k."""
    from smartgen.selectors.quest import dequantize_bounds, upper_bounds

    g = torch.Generator().manual_seed(seed)
    keys = scale * torch.randn(H, n, D_HEAD, generator=g)
    query = torch.randn(HQ, D_HEAD, generator=g)
    prefill = PrefillLayer(2, torch.randn(HQ, n, D_HEAD), keys, None)
    coded = QuestSelector(INFO, page_size=page_size, bound_bits=8).build_metadata(prefill)
    page_max, page_min = dequantize_bounds(coded)
    q = query.view(H, -1, 1, D_HEAD)
    rule = torch.maximum(q * page_max[:, None], q * page_min[:, None]).sum(-1).reshape(HQ, -1)  # [Hq, P]
    bounds = upper_bounds(query, coded)
    magnitude = query.abs().sum(-1, keepdim=True) * torch.maximum(page_max.abs(), page_min.abs()).amax()
    assert bounds.shape == rule.shape
    assert ((bounds - rule).abs() <= 1e-5 * magnitude).all()
    true = torch.einsum("hgd,hnd->hgn", query.view(H, -1, D_HEAD).double(), keys.double()).reshape(HQ, n)
    for p, start in enumerate(range(0, n, page_size)):
        page_true = true[:, start : start + page_size].amax(dim=1)
        assert (bounds[:, p].double() >= page_true - 1e-5 * magnitude[:, 0].double()).all()
    exact = QuestSelector(INFO, page_size=page_size, bound_bits=16).build_metadata(prefill)
    assert torch.equal(upper_bounds(query, exact), page_upper_bounds(query, exact["page_max"], exact["page_min"]))
