"""The engine at default block count and realistic prompt lengths over a paced link (slow: `make test-slow`)."""

import pytest
import torch

from smartgen.apps.simulate import SimulationConfig, compare, link_rate_for
from smartgen.engine.layout import KVLayout
from smartgen.engine.policy import POLICIES, get_policy

pytestmark = pytest.mark.slow


def test_all_policies_at_m_1024_with_a_paced_link():
    layout = KVLayout(num_layers=6, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)  # M = 1024
    config = SimulationConfig(
        layout, lengths=(6000, 1500, 700), steps=12, select_ratio=0.1, prefill_seconds_per_token=20e-6
    )
    config = SimulationConfig(
        **{**{f: getattr(config, f) for f in config.__slots__}, "gbps": link_rate_for(config, 4.7)}
    )
    policies = list(POLICIES.values()) + [
        get_policy("smartgen", strategy=s) for s in ("random", "streaming", "optimal")
    ]
    for result in compare(config, policies):
        assert result.mismatches == 0, result.policy
        assert result.max_fetch_count <= 1, result.policy
        assert result.prefill_requests_left == 0, result.policy
        if result.policy.startswith(("smartgen", "full")):
            assert result.all_local and result.pool_equals_prefill, result.policy
