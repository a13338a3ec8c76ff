"""HATA: packed Hamming distance against its torch reference, scores, weight serialisation, the training loss, and
that training improves recall over random hash weights on a tiny model."""

import pytest
import torch
from selector_models import hooked_tiny_llama

from smartgen.apps.selector_recall import selector_recall, trace_decode
from smartgen.runtime.prefill import capture_qk
from smartgen.selectors import make_selector
from smartgen.selectors.base import ModelInfo, PrefillLayer, StepQuery
from smartgen.selectors.hata import (
    HATASelector,
    hamming_reference,
    hash_bits,
    load_weights,
    pack_bits,
    packed_hamming,
    random_weights,
    save_weights,
    weights_from_bytes,
    weights_to_bytes,
)
from smartgen.selectors.hata_train import HashTrainingConfig, hash_loss, train_hash_weights, training_items

HQ, H, D_HEAD = 4, 2, 16
INFO = ModelInfo(num_layers=4, num_q_heads=HQ, num_kv_heads=H, head_dim=D_HEAD, hidden_size=64)


@pytest.mark.parametrize("rbit,group,n", [(8, 1, 1), (16, 2, 37), (128, 4, 65), (40, 3, 9)])
def test_packed_hamming_matches_the_reference(rbit, group, n):
    g = torch.Generator().manual_seed(rbit + n)
    q_bits = torch.rand(H, group, rbit, generator=g) > 0.5
    k_bits = torch.rand(H, n, rbit, generator=g) > 0.5
    got = packed_hamming(pack_bits(q_bits), pack_bits(k_bits))
    assert got.dtype == torch.int32 and got.shape == (H, group, n)
    assert torch.equal(got, hamming_reference(q_bits, k_bits))
    brute = (q_bits[:, :, None, :] != k_bits[:, None, :, :]).sum(-1).to(torch.int32)
    assert torch.equal(got, brute)


def test_pack_bits_layout_and_rejects_odd_widths():
    bits = torch.zeros(2, 16, dtype=torch.bool)
    bits[0, 0] = bits[0, 9] = bits[1, 15] = True
    assert pack_bits(bits).tolist() == [[1, 2], [0, 128]]
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_bits(torch.zeros(3, 12, dtype=torch.bool))


def test_hash_bits_are_the_signs_of_the_projection():
    weights = random_weights(INFO, rbit=24)
    x = torch.randn(H, 7, D_HEAD)
    expect = torch.stack([(x[h] @ weights[2][h]) > 0 for h in range(H)])
    assert torch.equal(hash_bits(x, weights[2]), expect)


@pytest.mark.parametrize("use_norm", [True, False])
def test_scores_match_a_brute_force_computation(use_norm):
    selector = HATASelector(INFO, budget=5, rbit=32, use_norm=use_norm, seed=3, gqa="sum")
    g = torch.Generator().manual_seed(1)
    keys, query = torch.randn(H, 30, D_HEAD, generator=g), torch.randn(HQ, D_HEAD, generator=g)
    meta = selector.build_metadata(PrefillLayer(2, torch.randn(HQ, 30, D_HEAD), keys, None))
    assert meta["codes"].dtype == torch.uint8 and meta["codes"].shape == (H, 30, 4)
    weight = selector.weights[2]
    expect = torch.zeros(H, 30)
    for j in range(HQ):
        h = j // (HQ // H)
        cq = ((query[j] @ weight[h]) > 0).float() * 2 - 1
        ck = ((keys[h] @ weight[h]) > 0).float() * 2 - 1  # [n, rbit]
        ham = (32 - ck @ cq) / 2
        expect[h] += 1 - 2 * ham / 32 if use_norm else -ham
    if use_norm:
        expect *= keys.norm(dim=-1)
    torch.testing.assert_close(selector.scores(query, meta, 2, 30), expect)
    index = selector.select(StepQuery(2, query[None], None, torch.tensor([30]), [30]), [meta])
    assert torch.equal(index, expect.topk(5).indices.sort().values)


def test_weights_round_trip_as_bytes_and_files(tmp_path):
    weights = random_weights(INFO, rbit=16, seed=5)
    assert sorted(weights) == [2, 3] and weights[2].shape == (H, D_HEAD, 16)
    back = weights_from_bytes(weights_to_bytes(weights))
    assert sorted(back) == [2, 3] and all(torch.equal(back[k], weights[k]) for k in weights)
    save_weights(weights, tmp_path / "w.safetensors")
    assert torch.equal(load_weights(tmp_path / "w.safetensors")[3], weights[3])
    from_bytes = make_selector("hata", INFO, weights=weights_to_bytes(weights))
    assert torch.equal(from_bytes.weights[2], weights[2])
    with pytest.raises(ValueError, match="shape"):
        HATASelector(INFO, weights={2: torch.randn(H, D_HEAD + 1, 16)})


def test_grouped_training_loss_equals_hatas_per_item_loss():
    config = HashTrainingConfig(rbit=16, queries_per_prompt=3, keys_per_query=40, keep_top=4)
    g = torch.Generator().manual_seed(0)
    items = training_items(torch.randn(HQ, 100, 8), torch.randn(H, 100, 8), config, g)
    weight = torch.randn(H, 8, 16, generator=g)
    got = hash_loss(weight, items, config)
    # HATA's formulation: every (query, key) item encoded on its own
    group, total, codes, count = HQ // H, 0.0, torch.zeros(HQ, 16), int(items.valid.sum())
    for u in range(items.queries.shape[0]):
        m = int(items.valid[u].sum())
        for j in range(HQ):
            w = weight[j // group]
            cq = 2 * torch.sigmoid(config.sigma * (items.queries[u, j] @ w)) - 1
            ck = 2 * torch.sigmoid(config.sigma * (items.keys[u, j // group, :m] @ w)) - 1
            total = total + (items.weights[u, j, :m] * (cq - ck).pow(2).sum(-1)).sum()
            codes[j] += (cq[None] + ck).sum(0)
    expect = config.epsilon * total / count + config.lam * (codes / count / 16).pow(2).sum()
    expect = expect + config.eta * torch.linalg.norm(weight @ weight.transpose(1, 2) - 2 * torch.eye(8))
    torch.testing.assert_close(got, expect)


def test_training_items_weight_the_top_keys_and_keep_them():
    config = HashTrainingConfig(queries_per_prompt=1, keys_per_query=20, keep_top=3, positive_ratio=0.1)
    g = torch.Generator().manual_seed(2)
    queries, keys = torch.randn(HQ, 80, 8, generator=g), torch.randn(H, 80, 8, generator=g)
    items = training_items(queries, keys, config, g)
    assert items.keys.shape[:3] == (1, H, 20) and items.weights.shape == (1, HQ, 20)
    # the best key of every head is an item and carries the top weight, 20
    assert (items.weights[0].amax(dim=-1) == 20).all()
    assert (items.weights[0] != 0).all() and items.valid.all()


@pytest.fixture(scope="module")
def tiny_llama():
    return hooked_tiny_llama(seed=0)


def test_training_improves_recall_over_random_weights(tiny_llama):
    model, info = tiny_llama
    g = torch.Generator().manual_seed(0)
    calibration = [torch.randint(3, 97, (160,), generator=g) for _ in range(8)]
    held_out = [torch.randint(3, 97, (160,), generator=g) for _ in range(4)]
    config = HashTrainingConfig(rbit=32, steps=100)
    trained = train_hash_weights(info, (capture_qk(model, p) for p in calibration), config)
    assert sorted(trained) == [2, 3] and trained[2].shape == (2, 16, 32)
    traces = [trace_decode(model, p[:150], p[150:]) for p in held_out]
    recall = {}
    for name, weights in (("random", None), ("trained", trained)):
        stats = None
        for trace in traces:
            selector = HATASelector(info, budget=0.1, weights=weights, rbit=32, seed=config.seed)
            stats = selector_recall(selector, 0.1, trace, stats)
        recall[name] = stats.overall("kv_recall")
    assert recall["trained"] > recall["random"] + 0.02, recall


def test_serve_loads_hata_weights_from_the_profile_store(tmp_path):
    """`smartgen serve --selector hata` builds its selector from the store's newest weights for the model, or
    refuses in one line."""
    from tiny_models import save_tiny_model

    from smartgen.roles.launch import NodeSettings, _load
    from smartgen.runtime.fingerprint import model_fingerprint
    from smartgen.runtime.models import load_model, model_info
    from smartgen.selectors.hata import random_weights, weights_to_bytes
    from smartgen.store import HashWeightsRecord, ProfileStore

    folder = save_tiny_model(tmp_path / "tiny")
    db = tmp_path / "p.db"
    settings = NodeSettings(folder, selector="hata", db=db)
    with pytest.raises(ValueError, match="no profile database at .*smartgen profile --selector hata"):
        _load(settings)
    model = load_model(folder)
    weights = random_weights(model_info(model), rbit=16, seed=3)
    with ProfileStore(db) as store:
        with pytest.raises(ValueError, match="no HATA hash weights for this model"):
            _load(settings)
        record = HashWeightsRecord(
            model_fingerprint(model), "tiny", 16, len(weights), "c.jsonl", "0" * 64, 1, 1, weights_to_bytes(weights)
        )
        store.add_hash_weights(record)
    _, _, selector = _load(settings)
    assert selector.name == "hata" and sorted(selector.weights) == sorted(weights)
    assert all(torch.equal(selector.weights[layer], weights[layer]) for layer in weights)


def test_gqa_max_scores_softmax_each_heads_estimated_logits_then_max():
    selector = HATASelector(INFO, budget=5, rbit=32, seed=3, gqa="max")
    g = torch.Generator().manual_seed(2)
    keys, query = torch.randn(H, 30, D_HEAD, generator=g), torch.randn(HQ, D_HEAD, generator=g)
    meta = selector.build_metadata(PrefillLayer(2, torch.randn(HQ, 30, D_HEAD), keys, None))
    weight, group = selector.weights[2], HQ // H
    logits = torch.zeros(H, group, 30)
    for j in range(HQ):
        h = j // group
        cq = ((query[j] @ weight[h]) > 0).float() * 2 - 1
        ck = ((keys[h] @ weight[h]) > 0).float() * 2 - 1
        cosine = 1 - 2 * ((32 - ck @ cq) / 2) / 32
        logits[h, j % group] = cosine * query[j].norm() * keys[h].norm(dim=-1) * D_HEAD**-0.5
    expect = logits.softmax(dim=-1).amax(dim=1)
    torch.testing.assert_close(selector.scores(query, meta, 2, 30), expect)
    index = selector.select(StepQuery(2, query[None], None, torch.tensor([30]), [30]), [meta])
    assert torch.equal(index, expect.topk(5).indices.sort().values)
    no_norm = HATASelector(INFO, budget=5, rbit=32, seed=3, gqa="max", use_norm=False)
    without_k = (logits / keys.norm(dim=-1)[:, None, :]).softmax(dim=-1).amax(dim=1)  # ‖k‖ left out
    torch.testing.assert_close(no_norm.scores(query, meta, 2, 30), without_k)


def test_gqa_max_keeps_the_token_one_sharp_head_needs():
    """Three heads spread their weight, one puts it on token 7: the max rule keeps token 7 (it is the exact top-k's score)."""
    from smartgen.selectors.base import group_max_probability
    from smartgen.selectors.topk import kv_head_scores

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 40, D_HEAD, generator=g)
    query = torch.randn(4, D_HEAD, generator=g) * 0.3
    query[0] = keys[0, 7] * 3  # head 0 attends sharply to token 7
    logits = torch.einsum("gd,nd->gn", query, keys[0])[None] * D_HEAD**-0.5  # [1, G, n]
    torch.testing.assert_close(group_max_probability(logits), kv_head_scores(query, keys))
    assert 7 in group_max_probability(logits).topk(4).indices


@pytest.mark.parametrize("name", ["hata", "quest", "infinigen"])
def test_an_unknown_gqa_rule_is_a_one_line_error(name):
    with pytest.raises(ValueError, match=f"{name}: gqa must be one of"):
        make_selector(name, INFO, budget=0.1, gqa="mean")
