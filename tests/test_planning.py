"""Layout, block importance, K_r, the proactive plan and the proactive-set strategies."""

import pytest
import torch

from smartgen.engine.layout import KVLayout, block_bounds, effective_blocks, resample_importance, token_blocks
from smartgen.engine.planning import (
    ImportanceAccumulator,
    Planner,
    plan_transfer,
    proactive_budget,
    speculative_slice_size,
    strategy_scores,
)


def test_blocks_partition_the_prompt():
    for length in (1, 5, 1023, 1024, 1025, 4099):
        bounds = block_bounds(length, 1024)
        assert bounds[0] == 0 and bounds[-1] == length
        assert bool((bounds[1:] > bounds[:-1]).all()), "no empty blocks, even for short prompts"
        assert len(bounds) - 1 == effective_blocks(length, 1024) == min(length, 1024)
        blocks = token_blocks(length, 1024)
        for m in range(len(bounds) - 1):
            assert bool((blocks[bounds[m] : bounds[m + 1]] == m).all())


def test_block_bounds_follow_the_formula():
    n, m = 10_000, 1024
    bounds = block_bounds(n, m)
    assert [int(bounds[i]) for i in (0, 1, 511, 1024)] == [0, n // m, 511 * n // m, n]


def test_resample_keeps_long_prompts_and_averages_for_short_ones():
    importance = torch.arange(8.0).view(1, 8)
    assert torch.equal(resample_importance(importance, 100), importance)
    # 3 tokens over 8 relative blocks: blocks {0,1,2}, {3,4,5}, {6,7}
    assert torch.allclose(resample_importance(importance, 3), torch.tensor([[1.0, 4.0, 6.5]]))


def test_layout_bytes_and_checks():
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    assert layout.token_bytes == 2 * 8 * 2
    assert layout.kv_bytes(10) == 2 * 4 * 10 * 32
    with pytest.raises(ValueError, match="at least 2 layers"):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=8)


def test_importance_is_the_mean_selection_count_of_a_blocks_entries():
    acc = ImportanceAccumulator(num_layers=2, num_blocks=4)
    counts = torch.zeros(2, 2, 8)  # [L, H, n]: 8 tokens, 2 per block
    counts[0, 0, 0] = 4  # block 0 of layer 0: entries (2 tokens x 2 heads), sum 4 -> mean 1
    counts[1, :, 6:] = 3  # block 3 of layer 1: every entry selected 3 times -> mean 3
    acc.add(counts)
    expected = torch.zeros(2, 4)
    expected[0, 0] = 1.0
    expected[1, 3] = 3.0
    assert torch.allclose(acc.importance(), expected)
    acc.add(torch.zeros(2, 2, 8))  # a second prompt that never selects halves the means
    assert torch.allclose(acc.importance(), expected / 2)


def test_k_r_formula_and_clip():
    L, M = 32, 1024
    # T_t = 4.7 T_p (the paper's 48K case): K_r = L·M·(31/32)/4.7
    assert proactive_budget(L, M, 1.0, 4.7) == int(L * M * (31 / 32) / 4.7)
    assert proactive_budget(L, M, 1.0, 1000.0) == 2 * M  # slow link: layers 0-1 only
    assert proactive_budget(L, M, 10.0, 1.0) == L * M  # fast link: everything
    assert proactive_budget(L, M, 1.0, 0.0) == L * M


def test_plan_sends_layers_0_1_then_top_blocks_with_deterministic_ties():
    scores = torch.zeros(4, 5)
    scores[2, 3] = 9.0
    scores[3, 1] = 8.0
    scores[3, 4] = 8.0  # tie with (3, 1): the lower block wins
    plan = plan_transfer(scores, budget=2 * 5 + 2)
    assert plan.proactive[:2].all()
    assert plan.proactive[2].nonzero().flatten().tolist() == [3]
    assert plan.proactive[3].nonzero().flatten().tolist() == [1]
    assert plan.num_proactive == 12
    # speculative: the rest, most important first, ties by (layer, block)
    assert plan.speculative_order.tolist()[:2] == [3 * 5 + 4, 2 * 5 + 0]
    assert sorted(plan.speculative_order.tolist() + plan.proactive.flatten().nonzero().flatten().tolist()) == list(
        range(20)
    )


def test_budget_is_clipped_to_the_plan():
    scores = torch.rand(3, 4)
    assert plan_transfer(scores, 0).num_proactive == 8
    assert plan_transfer(scores, 999).num_proactive == 12


@pytest.mark.parametrize("strategy", ["profile", "random", "sequential", "streaming", "optimal"])
def test_every_strategy_gives_a_valid_plan(strategy):
    L, n, M = 4, 200, 16
    importance = torch.rand(L, M)
    counts = torch.rand(L, 2, n)
    scores = strategy_scores(strategy, L, n, M, importance=importance, request_counts=counts, seed=3)
    assert scores.shape == (L, M)
    plan = plan_transfer(scores, 2 * M + 10)
    assert plan.num_proactive == 2 * M + 10


def test_streaming_takes_sinks_then_recent_blocks_in_every_layer():
    scores = strategy_scores("streaming", 4, 160, 16)
    plan = plan_transfer(scores, 2 * 16 + 2 * 3)
    for layer in (2, 3):
        assert plan.proactive[layer].nonzero().flatten().tolist() == [0, 14, 15]


def test_sequential_follows_prefill_order_and_random_is_seeded():
    plan = plan_transfer(strategy_scores("sequential", 4, 64, 16), 2 * 16 + 5)
    assert plan.proactive[2].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    a = strategy_scores("random", 4, 64, 16, seed=1)
    assert torch.equal(a, strategy_scores("random", 4, 64, 16, seed=1))
    assert not torch.equal(a, strategy_scores("random", 4, 64, 16, seed=2))


def test_optimal_picks_the_blocks_the_request_selects():
    counts = torch.zeros(4, 1, 64)
    counts[2, 0, 40:44] = 5  # block 10 of layer 2
    counts[3, 0, 0:4] = 5  # block 0 of layer 3
    plan = plan_transfer(strategy_scores("optimal", 4, 64, 16, request_counts=counts), 2 * 16 + 2)
    assert plan.proactive[2].nonzero().flatten().tolist() == [10]
    assert plan.proactive[3].nonzero().flatten().tolist() == [0]


def test_strategy_errors_are_clear():
    with pytest.raises(ValueError, match="unknown proactive strategy"):
        strategy_scores("nope", 4, 64, 16)
    with pytest.raises(ValueError, match="needs a profile"):
        strategy_scores("profile", 4, 64, 16)
    with pytest.raises(ValueError, match="no profile for this model"):
        Planner(4, 16).plan(64, "budget", "profile")


def test_speculative_slice_size():
    assert speculative_slice_size(1000, 0.1) == 100
    assert speculative_slice_size(7, 0.1) == 1
    with pytest.raises(ValueError):
        speculative_slice_size(10, 0.0)


def test_planner_scales_timings_with_length():
    planner = Planner(4, 16, torch.rand(4, 16), prefill_seconds_per_token=1e-3, transfer_seconds_per_token=2e-3)
    assert planner.budget(64, "all") == 64
    assert planner.budget(64, "floor") == 32
    assert planner.budget(64, "budget") == max(32, int(64 * (3 / 4) * 1e-3 / 2e-3))
    assert planner.budget(8, "floor") == 16  # short prompt: M_eff = 8 blocks per layer


def test_the_node_planner_learns_prefill_time_per_token_from_long_prefills_only():
    """A 2-token warm-up is almost all fixed overhead: counted, it made every token look 100x dearer, K_r covered
    every block, and fetches re-sent what the pushes were still carrying."""
    from smartgen.engine.layout import KVLayout
    from smartgen.roles.planner import NodePlanner

    planner = NodePlanner(KVLayout(4, 2, 8, num_blocks=16), None, "streaming", None)
    planner.record_prefill(2, 0.05)
    assert planner.prefill_seconds_per_token == 0.0
    planner.record_prefill(1000, 0.2)
    assert planner.prefill_seconds_per_token == pytest.approx(2e-4)
    planner.record_prefill(500, 0.2)  # length-weighted: the long prefill counts for more
    assert planner.prefill_seconds_per_token == pytest.approx((0.8 * 0.2 + 0.2) / (0.8 * 1000 + 500))


def test_k_r_leaves_out_the_link_time_metadata_takes_ahead_of_the_pushes():
    L, M = 32, 1024
    assert proactive_budget(L, M, 1.0, 4.7, 0.0) == proactive_budget(L, M, 1.0, 4.7)
    window = 31 / 32 * 1.0
    assert proactive_budget(L, M, 1.0, 4.7, 0.25 * window) == int(L * M * 0.75 * window / 4.7)
    assert proactive_budget(L, M, 1.0, 4.7, 2.0) == 2 * M  # metadata alone fills the window: layers 0-1


def test_the_node_planner_reserves_the_metadata_it_measured():
    """Selector metadata goes on the control lane ahead of the pushes: its link time is not the proactive set's."""
    from smartgen.engine.layout import KVLayout
    from smartgen.roles.planner import NodePlanner

    layout = KVLayout(4, 2, 8, num_blocks=16)
    planner = NodePlanner(layout, None, "streaming", 0.004, prefill_seconds_per_token=1e-3)
    before = planner.plan(1000, "budget", "streaming").proactive.sum()
    planner.record_metadata(1000, 1000 * layout.kv_bytes(1) // 8)  # an eighth of the KV's bytes per token
    after = planner.plan(1000, "budget", "streaming").proactive.sum()
    t_t = planner.link_seconds_per_token
    expected = proactive_budget(4, 16, 1e-3 * 1000, t_t * 1000, t_t * 1000 / 8)
    assert after == expected < before
