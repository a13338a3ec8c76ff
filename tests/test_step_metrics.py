"""Each request reports how much of its first decode step's selection was already local and how long decoding
waited for the link, the figures that say where TTST and TBT go."""

import pytest
import torch
from tiny_models import tiny_config

from smartgen.engine.policy import get_policy
from smartgen.runtime.models import model_from_config
from smartgen.runtime.pipeline import InprocPipeline

LENGTH = 256


def _run(scheme: str, gbps: float = 0.02):
    model = model_from_config(tiny_config("llama"))
    policy = get_policy(scheme, "sequential", 0.05)
    prompt = torch.randint(3, 97, (LENGTH,), generator=torch.Generator().manual_seed(5))
    with InprocPipeline(model, policy, "quest", {"budget": 0.25}, gbps=gbps, prefill_seconds_per_token=1e-5) as p:
        (result,) = p.generate([prompt], 8)
    return result.metrics


def test_a_partial_transfer_waits_for_what_its_first_step_lacks():
    metrics = _run("partial")
    assert metrics.first_step_selected > 0 and 0.0 <= metrics.first_step_coverage < 1.0
    assert metrics.first_step_remote <= metrics.remote_entries
    assert 0.0 < metrics.first_step_wait_s <= metrics.fetch_wait_s
    assert metrics.first_step_wait_s < metrics.ttst  # waiting is part of the second token's time
    snapshot = metrics.snapshot()
    assert snapshot["first_step_coverage"] == pytest.approx(metrics.first_step_coverage)
    assert snapshot["fetch_wait_s"] == metrics.fetch_wait_s


def test_full_transfer_starts_decoding_with_everything_local():
    metrics = _run("full")
    assert metrics.first_step_coverage == 1.0 and metrics.remote_entries == 0


def test_each_token_reports_the_distinct_entries_selected_by_then():
    """The union grows with each step, never past layers >= 2's KV, and equals what the selections covered."""
    model = model_from_config(tiny_config("llama"))
    prompt = torch.randint(3, 97, (LENGTH,), generator=torch.Generator().manual_seed(5))
    with InprocPipeline(model, get_policy("full"), "topk", {"budget": 1.0}) as p:
        (every,) = p.generate([prompt], 4)
    config = model.config
    heads, dim = config.num_key_value_heads, config.head_dim
    whole = (config.num_hidden_layers - 2) * LENGTH * heads * 2 * dim * 4  # K and V of layers >= 2, fp32
    # selecting every token: step one selects all of it, and later steps add nothing
    assert every.metrics.union_bytes_at_token == [0, whole, whole, whole]
    metrics = _run("partial")
    union = metrics.union_bytes_at_token
    assert len(union) == len(metrics.token_times) and union[0] == 0
    assert union == sorted(union) and 0 < union[1] < whole
    assert metrics.selected_union_bytes == union[-1]
