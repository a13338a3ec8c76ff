"""The first step's forecast: the prefill node runs the first decode step as the decode node will (attending to
what the selector picks) and sends its queries; the decode node fetches that step's picks ahead (low priority),
and the answers never change."""

import queue

import torch
from tiny_models import tiny_config

from smartgen.engine import messages as msg
from smartgen.engine.policy import get_policy
from smartgen.lanes.base import Message, MessageKind
from smartgen.lanes.queued import STOP, PriorityOutbox
from smartgen.runtime.models import model_from_config, model_info
from smartgen.runtime.pipeline import InprocPipeline
from smartgen.runtime.prefill import PrefillRunner, capture_qk
from smartgen.selectors.quest import QuestSelector


def test_forecast_first_token_and_low_fetch_cross_the_wire_and_bad_ones_are_refused():
    queries = {2: torch.randn(4, 8), 5: torch.randn(4, 8)}
    back = msg.unpack(msg.Forecast("r", queries).pack())
    assert isinstance(back, msg.Forecast) and sorted(back.queries) == [2, 5]
    assert torch.equal(back.queries[5], queries[5])
    assert msg.unpack(msg.FirstToken("r", 3, forecast=True).pack()).forecast is True
    assert msg.unpack(msg.FirstToken("r", 3).pack()).forecast is False  # a peer that never forecasts
    fetch = msg.Fetch("r", 2, 9, torch.tensor([1, 4]), low=True)
    assert (
        msg.unpack(fetch.pack()).low is True and msg.unpack(msg.Fetch("r", 2, 9, torch.tensor([1])).pack()).low is False
    )
    bad = Message(MessageKind.FORECAST, "r", {}, {"x": torch.randn(4, 8)})
    try:
        msg.unpack(bad)
    except msg.MessageError as exc:
        assert "layer" in str(exc)
    else:
        raise AssertionError("a FORECAST keyed by something other than a layer must be refused")


def test_the_outbox_sends_low_priority_messages_after_everything_queued_before_or_after_them():
    outbox = PriorityOutbox()
    low = Message(MessageKind.FETCH_REPLY, "joiner", priority=1)
    outbox.put(low)
    first, second = Message(MessageKind.FETCH_REPLY, "a"), Message(MessageKind.FETCH_REPLY, "b")
    outbox.put(first)
    outbox.put(STOP)
    outbox.put(second)
    assert [outbox.get_nowait() for _ in range(4)] == [first, STOP, second, low]  # in order within a priority
    try:
        outbox.get_nowait()
    except queue.Empty:
        pass
    else:
        raise AssertionError("the outbox should be empty")


def test_the_prefill_runners_forecast_is_the_first_steps_query():
    """Without a selector the forecast's step is dense: each query is the one a pass over the prompt and the first
    token gives. With one, layer 2 (the first that selects; layers 0-1 attend densely) still gives that query, and
    later layers that of a step attending to what the selector picks, as the decode node's does."""
    model = model_from_config(tiny_config("llama"))
    info = model_info(model)
    prompt = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    dense = PrefillRunner(model, None)
    output = dense.run(prompt, keep_cache=True)
    queries = dense.forecast(output)
    whole, _ = capture_qk(model, prompt + [output.first_token])  # the prompt and the first token in one pass
    assert sorted(queries) == list(range(2, model.config.num_hidden_layers))
    for layer, query in queries.items():
        torch.testing.assert_close(query.float(), whole[layer][:, -1], atol=1e-4, rtol=1e-4)
    assert output.cache is None  # the copy of the K/V goes once the forecast ran

    sparse = PrefillRunner(model, QuestSelector(info, budget=0.3))
    output = sparse.run(prompt, keep_cache=True)
    queries = sparse.forecast(output)
    assert sorted(queries) == list(range(2, model.config.num_hidden_layers))
    torch.testing.assert_close(queries[2].float(), whole[2][:, -1], atol=1e-4, rtol=1e-4)
    last = max(queries)
    assert not torch.allclose(queries[last].float(), whole[last][:, -1], atol=1e-4, rtol=1e-4)  # 30% of the prompt


def _generate(scheme: str):
    model = model_from_config(tiny_config("llama"))
    prompts = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (200, 150)]
    policy = get_policy(scheme, "sequential", 0.05)
    # a link slow against prefill: the proactive set holds little of step one, so its picks must be fetched
    with InprocPipeline(
        model, policy, "quest", {"budget": 0.25}, gbps=0.02, prefill_seconds_per_token=1e-5, num_blocks=16
    ) as pipeline:
        return pipeline.generate(prompts, 6)


def test_a_forecast_fetches_step_ones_picks_ahead_and_changes_no_answer():
    full, plain, forecast = _generate("full"), _generate("smartgen-no-forecast"), _generate("smartgen")
    assert [r.tokens for r in forecast] == [r.tokens for r in full] == [r.tokens for r in plain]
    # the second request's first token comes while the first decodes on the slow link: its picks were asked for
    # before its first step (the first, alone, starts at once and asks as it goes)
    assert forecast[1].metrics.forecast_entries > 0 and forecast[0].metrics.forecast_entries == 0
    # the forecast attends as the sparse step does, so it foresees that step's picks (a dense one: 89% here; the
    # decode node's rows are summed in another order, so a near tie may still go the other way)
    assert forecast[1].metrics.first_step_foreseen >= 0.97, forecast[1].metrics.first_step_foreseen
    assert all(r.metrics.forecast_entries == 0 for r in plain)
