"""The first step's forecast: the prefill node runs the first decode step as the decode node will (attending to
what the selector picks) and sends its queries; the decode node fetches that step's picks ahead (low priority),
and the answers never change."""

import queue

import pytest
import torch
from tiny_models import tiny_config
from transformers import DynamicCache

from smartgen.engine import messages as msg
from smartgen.engine.policy import get_policy
from smartgen.lanes.base import Message, MessageKind
from smartgen.lanes.queued import STOP, PriorityOutbox
from smartgen.runtime.cache_kwarg import with_cache
from smartgen.runtime.hooks import dense_attention, use_handler
from smartgen.runtime.models import model_from_config, model_info
from smartgen.runtime.pipeline import InprocPipeline
from smartgen.runtime.prefill import PrefillRunner, capture_qk
from smartgen.selectors import SELECTORS, make_selector
from smartgen.selectors.base import StepQuery
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
    second = msg.SecondToken(7, torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    back = msg.unpack(msg.Forecast("r", queries, second).pack())
    assert back.second is not None and back.second.token == 7 and torch.equal(back.second.values, second.values)
    assert msg.unpack(msg.Forecast("r", queries).pack()).second is None
    assert msg.unpack(msg.Forecast("r", queries, step=2).pack()).step == 2
    for meta, payload in (
        ({"token": 7}, {}),  # a token without its K/V
        ({"token": 7}, {"k": second.keys, "v": second.values[:2]}),  # K and V of other shapes
        ({}, {"k": second.keys, "v": second.values}),  # K/V without the token
        ({"token": -1}, {"k": second.keys, "v": second.values}),
        ({"step": 3}, {}),
        ({"token": 7, "step": 2}, {"k": second.keys, "v": second.values}),  # the second token is step one's
    ):
        try:
            msg.unpack(Message(MessageKind.FORECAST, "r", meta, payload))
        except msg.MessageError:
            pass
        else:
            raise AssertionError(f"a FORECAST with {meta} and {sorted(payload)} must be refused")
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
    forecasted = dense.forecast(output)
    queries = forecasted.queries
    whole, keys = capture_qk(model, prompt + [output.first_token])  # the prompt and the first token in one pass
    assert sorted(queries) == list(range(2, model.config.num_hidden_layers))
    for layer, query in queries.items():
        torch.testing.assert_close(query.float(), whole[layer][:, -1], atol=1e-4, rtol=1e-4)
    assert output.cache is None  # the copy of the K/V goes once the forecast ran
    # the step's token is the greedy second token, and its K/V the first token's, every layer
    cache = DynamicCache()
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([prompt + [output.first_token]]), **with_cache(model, cache), use_cache=True
        ).logits
    assert forecasted.token == int(logits[0, -1].argmax())
    assert forecasted.keys.shape == forecasted.values.shape == (model.config.num_hidden_layers, *keys[0].shape[::2])
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(forecasted.keys[layer].float(), keys[layer][:, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(forecasted.values[layer], cache.layers[layer].values[0, :, -1], atol=1e-4, rtol=1e-4)

    sparse = PrefillRunner(model, QuestSelector(info, budget=0.3))
    output = sparse.run(prompt, keep_cache=True)
    queries = sparse.forecast(output).queries
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
    full, plain = _generate("full"), _generate("smartgen-no-forecast")
    forecast = _generate("smartgen-no-second-token")
    assert [r.tokens for r in forecast] == [r.tokens for r in full] == [r.tokens for r in plain]
    # the request that joins the running batch asks for its picks before its first step (the one that runs first,
    # alone, starts at once and asks as it goes); which of the two runs first is the prefill side's timing (under
    # load the second's first token can be in before the first's forecast)
    [joiner] = [r for r in forecast if r.metrics.forecast_entries > 0]
    assert sum(r.metrics.forecast_entries == 0 for r in forecast) == 1
    # the forecast attends as the sparse step does, so it foresees that step's picks (a dense one: 89% here; the
    # decode node's rows are summed in another order, so a near tie may still go the other way)
    assert joiner.metrics.first_step_foreseen >= 0.97, joiner.metrics.first_step_foreseen
    assert all(r.metrics.forecast_entries == 0 for r in plain)


def test_the_forecast_steps_token_is_the_second_and_the_answers_stay_full_transfers():
    """Policy.second_token: every request's second token comes from the prefill node's forecast step (its time is
    the FORECAST's arrival, before the decode node ran a step for it), the first token's K/V with it, and every
    answer is full transfer's."""
    full, second = _generate("full"), _generate("smartgen-no-head-start")  # smartgen's head start: test_head_start
    assert [r.tokens for r in second] == [r.tokens for r in full]
    for result in second:
        assert result.metrics.prefill_tokens == 2
        assert result.metrics.forecast_entries > 0  # alone or not, it fetched the forecast's picks
    # the joiner fetched the picks of its own first step (the next step's forecast, exact), not step one's; the one
    # that ran first, alone, fetched step one's as it started (which of the two joins is the prefill side's timing)
    foreseen = sorted(r.metrics.first_step_foreseen for r in second)
    assert foreseen[-1] >= 0.97, foreseen
    assert all(r.metrics.prefill_tokens == 1 for r in full)
    # a request that ends at its second token never runs a decode step
    model = model_from_config(tiny_config("llama"))
    prompt = torch.randint(3, 97, (120,), generator=torch.Generator().manual_seed(4))
    with InprocPipeline(
        model,
        get_policy("smartgen", "sequential", 0.05),
        "quest",
        {"budget": 0.25},
        gbps=0.02,
        prefill_seconds_per_token=1e-5,
        num_blocks=16,
    ) as pipeline:
        calls = []
        step = pipeline.decode_runner.step
        pipeline.decode_runner.step = lambda batch: calls.append(1) or step(batch)
        (result,) = pipeline.generate([prompt], 2)
    assert len(result.tokens) == 2 and result.metrics.prefill_tokens == 2 and not calls


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_every_selector_forecasts_on_the_prefill_node(name):
    """Each selector the nodes take runs the forecast step: sparse where it picks by the query, dense for a dense or
    look-ahead one; a query per layer that selects."""
    model = model_from_config(tiny_config("llama"))
    selector = make_selector(name, model_info(model), **({} if name == "dense" else {"budget": 0.3}))
    runner = PrefillRunner(model, selector)
    output = runner.run(
        torch.randint(3, 97, (64,), generator=torch.Generator().manual_seed(5)).tolist(), keep_cache=True
    )
    queries = runner.forecast(output).queries
    assert sorted(queries) == list(range(2, model.config.num_hidden_layers))
    assert all(q.shape == (model.config.num_attention_heads, model_info(model).head_dim) for q in queries.values())


class _MaskedStep:
    """The reference for the forecast step: HF's own attention over the prompt and the token, with a mask that lets
    each sparse layer's query heads see only what the selector picks for their KV head (and the token itself)."""

    needs_mask = True

    def __init__(self, runner: PrefillRunner, output) -> None:
        self.runner, self.output = runner, output
        self.queries: dict[int, torch.Tensor] = {}
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the token's K/V [H, d] per layer

    def attend(self, module, query, key, value, attention_mask, **kwargs):
        layer, n = module.layer_idx, self.output.length
        self.kv[layer] = key[0, :, -1].clone(), value[0, :, -1].clone()
        if layer < 2 or not self.runner.kinds.is_full(layer):
            return dense_attention(module, query, key, value, attention_mask, **kwargs)
        step = query[:, :, -1]
        self.queries[layer] = step[0].clone()
        picked = self.runner.selector.select(
            StepQuery(layer, step, None, torch.tensor([key.shape[2] - 1]), [n]), [self.output.metadata[layer]]
        )
        heads = key.shape[1]
        allow = torch.zeros(heads, key.shape[2], dtype=torch.bool)
        for head in range(heads):
            allow[head, picked[head][picked[head] >= 0]] = True
        allow[:, n:] = True  # the tokens generated before this one, and the one being decoded
        mask = allow.repeat_interleave(query.shape[1] // heads, 0)[None, :, None, :]  # [1, Hq, 1, n + 1]
        return dense_attention(module, query, key, value, mask, **kwargs)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3", "granite"])
def test_the_forecast_step_attends_to_the_selectors_picks_as_a_masked_dense_step_does(family):
    """Against HF's attention with a mask: the same queries in every layer, for plain, soft-capped (eager),
    sliding-window and scaled (attention multiplier) attention."""
    model = model_from_config(tiny_config(family))
    runner = PrefillRunner(model, QuestSelector(model_info(model), budget=0.25))
    prompt = torch.randint(3, 97, (48,), generator=torch.Generator().manual_seed(11)).tolist()
    output = runner.run(prompt, keep_cache=True)
    reference = _MaskedStep(runner, output)
    token = torch.tensor([[output.first_token]])
    with torch.no_grad(), use_handler(reference):
        logits = model(
            input_ids=token,
            position_ids=torch.tensor([[output.length]]),
            **with_cache(model, output.cache),
            use_cache=True,
        ).logits
    forecasted = runner.forecast(runner.run(prompt, keep_cache=True))  # its own copy of the prompt's cache
    queries = forecasted.queries
    assert queries and sorted(queries) == sorted(reference.queries)
    for layer, query in queries.items():
        torch.testing.assert_close(query.float(), reference.queries[layer].float(), atol=1e-4, rtol=1e-4)
    # the second token and the first token's K/V, every layer (sliding-window ones too), are the masked step's
    assert forecasted.token == int(logits[0, -1].argmax())
    for layer, (k, v) in reference.kv.items():
        torch.testing.assert_close(forecasted.keys[layer], k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(forecasted.values[layer], v, atol=1e-4, rtol=1e-4)
    # the step after, on the second token: the prompt's picks, the first token and itself, as the decode node's
    reference.queries = {}
    with torch.no_grad(), use_handler(reference):
        model(
            input_ids=torch.tensor([[forecasted.token]]),
            position_ids=torch.tensor([[output.length + 1]]),
            **with_cache(model, output.cache),
            use_cache=True,
        )
    mine = runner.run(prompt, keep_cache=True)
    runner.forecast(mine, keep_cache=True)
    queries = runner.forecast_next(mine, forecasted.token)
    assert mine.cache is None and sorted(queries) == sorted(reference.queries)
    for layer, query in queries.items():
        torch.testing.assert_close(query.float(), reference.queries[layer].float(), atol=1e-4, rtol=1e-4)
