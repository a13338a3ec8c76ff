"""Oracle recall: traces of real decode steps, the oracle scoring itself perfectly, and a window checked by hand."""

import pytest
import torch
from selector_models import hooked_tiny_llama

from smartgen.apps.selector_recall import RecallStats, retrieval_heads, selector_recall, trace_decode
from smartgen.selectors import make_selector
from smartgen.selectors.base import budget_tokens

N, STEPS = 90, 4


@pytest.fixture(scope="module")
def traced():
    model, info = hooked_tiny_llama(seed=1)
    ids = torch.randint(3, 97, (N + STEPS,), generator=torch.Generator().manual_seed(0))
    needle = torch.zeros(N, dtype=torch.bool)
    needle[40:44] = True
    return model, info, trace_decode(model, ids[:N], ids[N:], needle)


def test_the_trace_holds_every_layer_and_the_decode_positions(traced):
    model, info, trace = traced
    assert trace.prompt_length == N and list(trace.steps) == list(range(N, N + STEPS - 1))
    assert sorted(trace.queries) == list(range(info.num_layers))
    assert trace.queries[2].shape == (info.num_q_heads, N + STEPS, info.head_dim)
    assert trace.keys[2].shape == (info.num_kv_heads, N + STEPS, info.head_dim)
    assert trace.hidden[2].shape == (N + STEPS, info.hidden_size)
    assert trace.scale == pytest.approx(info.head_dim**-0.5)


def test_the_oracle_and_the_dense_selector_recall_everything(traced):
    _, info, trace = traced
    oracle = selector_recall(make_selector("topk", info, budget=0.2), 0.2, trace)
    assert oracle.overall("kv_recall") == pytest.approx(1.0)
    assert oracle.overall("size") == pytest.approx(1.0)
    torch.testing.assert_close(oracle.mean("mass")[2:], oracle.mean("mass")[2:].clamp(max=1))
    dense = selector_recall(make_selector("dense", info), 0.2, trace)
    assert dense.overall("kv_recall") == pytest.approx(1.0) and dense.overall("mass") == pytest.approx(1.0)
    assert dense.overall("needle_hit") == pytest.approx(1.0)
    # layers 0-1 are never scored
    assert oracle.mean("kv_recall")[:2].isnan().all()


def test_streaming_recall_equals_a_count_by_hand(traced):
    _, info, trace = traced
    stats = selector_recall(make_selector("streaming", info, budget=0.2, sinks=4), 0.2, trace)
    k = budget_tokens(0.2, N)
    window = set(range(4)) | set(range(N - (k - 4), N))
    group = info.group_size
    expect = torch.zeros(info.num_kv_heads)
    for position in trace.steps:
        q = trace.queries[3][:, position].view(info.num_kv_heads, group, -1)
        probs = (torch.einsum("hgd,hnd->hgn", q, trace.keys[3][:, :N]) * trace.scale).softmax(-1).amax(1)
        top = probs.topk(k).indices
        expect += torch.tensor([len(window & set(row.tolist())) / k for row in top])
    torch.testing.assert_close(stats.mean("kv_recall")[3], (expect / len(trace.steps)).double())
    assert stats.mean("needle_hit")[3].max() == 0  # the needle (40-43) is outside the window


def test_stats_merge_and_retrieval_heads():
    a, b = RecallStats(3, 2, 1), RecallStats(3, 2, 1)
    a.add("needle_mass", 2, torch.tensor([0.5, 0.0]))
    b.add("needle_mass", 2, torch.tensor([0.1, 0.0]))
    merged = a.merge(b)
    torch.testing.assert_close(merged.mean("needle_mass")[2], torch.tensor([0.3, 0.0], dtype=torch.float64))
    assert retrieval_heads(merged, threshold=0.2) == [(2, 0)]
    assert merged.overall("needle_mass", [(2, 0)]) == pytest.approx(0.3)
