"""The prefill node's head start (Policy.head_start): a greedy request's prefill node decodes on from its second token
while it has nothing else to prefill and the request's KV is still leaving, each token sent at once with the K/V of
the one before; the decode node streams them, adds their K/V and takes over when they end. Same answers."""

import threading
import time

import pytest
import torch
from tiny_models import tiny_config

from smartgen.engine import messages as msg
from smartgen.engine.policy import get_policy
from smartgen.lanes.base import Message, MessageKind
from smartgen.runtime.driver import Finished
from smartgen.runtime.emulation import Emulation
from smartgen.runtime.models import model_from_config, model_info
from smartgen.runtime.pipeline import InprocPipeline, wait_until
from smartgen.runtime.prefill import PrefillRunner, StepYielded
from smartgen.selectors import make_selector


def test_head_start_tokens_and_open_limits_cross_the_wire_and_bad_ones_are_refused():
    head = msg.SecondToken(9, torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    back = msg.unpack(msg.Forecast("r", {}, head, step=3).pack())
    assert back.step == 3 and back.second is not None and back.second.token == 9
    assert torch.equal(back.second.keys, head.keys)
    opened = msg.Open("r", 0, 10, "smartgen", "profile", 0.1, head_tokens=62)
    assert msg.unpack(opened.pack()).head_tokens == 62
    assert msg.unpack(msg.Open("r", 0, 10, "smartgen", "profile", 0.1).pack()).head_tokens == 0
    for bad in (
        Message(MessageKind.FORECAST, "r", {"step": 3}, {}),  # a head-start step without its token
        Message(MessageKind.FORECAST, "r", {"step": 4}, {}),
        Message(MessageKind.OPEN, "r", {**opened.pack().meta, "head_tokens": -1}, {}),
    ):
        with pytest.raises(msg.MessageError):
            msg.unpack(bad)


def test_a_head_start_needs_the_second_token():
    with pytest.raises(ValueError, match="head_start needs second_token"):
        get_policy("smartgen-no-second-token").__class__("x", forecast=True, head_start=True)
    assert get_policy("smartgen").head_start and not get_policy("smartgen-no-head-start").head_start


def _pipeline(scheme: str, gbps: float) -> InprocPipeline:
    model = model_from_config(tiny_config("llama"))
    policy = get_policy(scheme, "sequential", 0.05)
    return InprocPipeline(
        model, policy, "quest", {"budget": 0.25}, gbps=gbps, prefill_seconds_per_token=1e-5, num_blocks=16
    )


def _generate(scheme: str, prompts: list[torch.Tensor], tokens: int, gbps: float = 0.02):
    with _pipeline(scheme, gbps) as pipeline:
        calls: list[int] = []
        step = pipeline.decode_runner.step
        pipeline.decode_runner.step = lambda batch: calls.append(len(batch.request_ids)) or step(batch)
        return pipeline.generate(prompts, tokens), calls


def _prompts(*lengths: int) -> list[torch.Tensor]:
    return [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]


def test_a_lone_request_on_a_slow_link_gets_every_token_from_its_prefill_node_with_full_transfers_answer():
    prompts = _prompts(200)
    (full,), _ = _generate("full", prompts, 8, gbps=0.005)
    (ahead,), steps = _generate("smartgen", prompts, 8, gbps=0.005)
    assert ahead.tokens == full.tokens
    # its KV (0.3 s of this 5 Mbit/s link) is still crossing when the answer ends: the decode node never ran a step
    assert ahead.metrics.prefill_tokens == 8 and not steps
    assert len(ahead.metrics.token_times) == 8 and ahead.metrics.token_times == sorted(ahead.metrics.token_times)
    (plain,), plain_steps = _generate("smartgen-no-head-start", prompts, 8, gbps=0.005)
    assert plain.tokens == full.tokens and plain.metrics.prefill_tokens == 2 and len(plain_steps) == 6


def test_the_decode_node_takes_over_once_the_kv_has_all_left():
    """On a fast link the KV has all left after a few head-start steps: the decode node decodes the rest, from the
    token the prefill node stopped at, with the K/V of every token before it in its pool."""
    prompts = _prompts(160)
    (full,), _ = _generate("full", prompts, 24, gbps=5.0)
    (ahead,), steps = _generate("smartgen", prompts, 24, gbps=5.0)
    assert ahead.tokens == full.tokens
    assert 2 <= ahead.metrics.prefill_tokens < 24
    assert len(steps) == 24 - ahead.metrics.prefill_tokens


def test_no_head_start_while_another_request_waits_for_prefill():
    """A head start only uses the prefill node's idle time: the first request, whose forecast runs while the others
    wait for prefill, gets none; the last one, with nothing behind it, gets one. Answers stay full transfer's."""
    prompts = _prompts(200, 180, 150)
    full, _ = _generate("full", prompts, 6)
    ahead, _ = _generate("smartgen", prompts, 6)
    assert [r.tokens for r in ahead] == [r.tokens for r in full]
    assert ahead[0].metrics.prefill_tokens == 2
    assert ahead[-1].metrics.prefill_tokens == 6


def test_a_head_start_stops_at_the_answers_end():
    """max_tokens bounds it (OPEN allows max_tokens - 2), and the decode node's tokens never run past the answer."""
    prompts = _prompts(200)
    (full,), _ = _generate("full", prompts, 3)
    (ahead,), steps = _generate("smartgen", prompts, 3)
    assert ahead.tokens == full.tokens and len(ahead.tokens) == 3 and ahead.metrics.prefill_tokens == 3 and not steps


def test_the_prefill_runners_decode_steps_pay_the_emulated_compute():
    model = model_from_config(tiny_config("llama"))
    runner = PrefillRunner(model, make_selector("quest", model_info(model), budget=0.3))
    output = runner.run(
        torch.randint(3, 97, (64,), generator=torch.Generator().manual_seed(5)).tolist(), keep_cache=True
    )
    first = runner.forecast(output, keep_cache=True)
    for emulation in (Emulation(added_s=0.01), Emulation(floor_s=0.01)):
        runner.emulation = emulation
        started = time.monotonic()
        step = runner.step_ahead(output, first.token)
        assert time.monotonic() - started >= 0.01 * model.config.num_hidden_layers
        assert step.keys.shape == first.keys.shape and 0 <= step.token < model.config.vocab_size
        assert emulation.slept_s > 0


def test_the_kv_keeps_crossing_during_a_head_start_so_the_decode_node_takes_over():
    """The decode node sends no idle notices while the prefill node decodes: each head-start step stands for one, so
    speculation goes on and the KV (a few prefills' worth of link time here) has all left long before the answer
    ends; the decode node then decodes the rest."""
    prompts = _prompts(200)
    (full,), _ = _generate("full", prompts, 48, gbps=0.2)
    (ahead,), steps = _generate("smartgen", prompts, 48, gbps=0.2)
    assert ahead.tokens == full.tokens
    assert 2 < ahead.metrics.prefill_tokens < 48 and len(steps) == 48 - ahead.metrics.prefill_tokens


def test_a_head_start_step_given_up_mid_step_leaves_the_cache_as_it_was():
    """`yield_to` is asked before each layer; True abandons the step with the layers it ran cut back out of the kept
    cache, so the next step computes exactly what it would have without the abandoned one."""
    model = model_from_config(tiny_config("llama"))
    runner = PrefillRunner(model, make_selector("quest", model_info(model), budget=0.3))
    prompt = torch.randint(3, 97, (64,), generator=torch.Generator().manual_seed(8)).tolist()
    outputs = [runner.run(prompt, keep_cache=True) for _ in range(2)]
    firsts = [runner.forecast(output, keep_cache=True) for output in outputs]
    length = outputs[0].cache.get_seq_length()
    asked: list[int] = []
    with pytest.raises(StepYielded):
        runner.step_ahead(outputs[0], firsts[0].token, yield_to=lambda: asked.append(1) or len(asked) == 2)
    assert len(asked) == 2  # the first layer ran, the second gave way
    assert [layer.keys.shape[-2] for layer in outputs[0].cache.layers] == [length] * model.config.num_hidden_layers
    again, untouched = (runner.step_ahead(output, first.token) for output, first in zip(outputs, firsts))
    assert again.token == untouched.token
    assert torch.equal(again.keys, untouched.keys) and torch.equal(again.values, untouched.values)


def _lone(prompt: torch.Tensor, tokens: int) -> list[int]:
    (result,), _ = _generate("full", [prompt], tokens)
    return result.tokens


@pytest.mark.parametrize("held_call", [2, 3])
def test_a_prompt_arriving_mid_step_takes_the_prefill_node_from_the_head_start_at_the_next_layer(held_call: int):
    """A head start only uses idle time: a prompt that arrives while a head-start step runs does not wait for the
    step, which is given up at its next layer; the decode node takes over the first request from its last streamed
    token (after a first step given up, from the second token, with no forecast of its own first step: that step
    would hold the prompt up too). Both answers are full transfer's."""
    prompts = _prompts(200, 150)
    expected = [_lone(prompt, 10) for prompt in prompts]
    with _pipeline("smartgen", 0.005) as pipeline:
        runner, real = pipeline.prefill_runner, pipeline.prefill_runner.step_ahead
        held, steps = threading.Event(), []

        def step_ahead(output, token, *, yield_to=None):
            steps.append("ran")
            ask = yield_to
            # the forecast step (the second token) runs through here too: call 2 is the first head-start step, 3 the
            # second; the held one waits at its second layer until the prompt has arrived
            if len(steps) == held_call:
                asked: list[int] = []

                def ask() -> bool:
                    asked.append(1)
                    if len(asked) == 2:
                        held.set()
                        wait_until(yield_to, 10)
                    return yield_to()

            try:
                return real(output, token, yield_to=ask)
            except StepYielded:
                steps[-1] = "yielded"
                raise

        runner.step_ahead = step_ahead
        first, second = pipeline._requests(prompts, 10, None, False)
        finished: dict[str, Finished] = {}
        with pipeline._running() as (driver, errors):
            driver.add(first)
            added, deadline = False, time.monotonic() + 60
            while first.request_id not in finished or second.request_id not in finished:
                assert time.monotonic() < deadline, f"stuck: {steps}"
                if held.is_set() and not added:
                    driver.add(second)
                    added = True
                events = driver.step()
                finished.update({e.request_id: e for e in events if isinstance(e, Finished)})
                time.sleep(0.001)
            assert not errors
    assert steps[:held_call] == ["ran"] * (held_call - 1) + ["yielded"]
    assert finished[first.request_id].tokens == expected[0] and finished[second.request_id].tokens == expected[1]
    # the first token, the second, and each head-start token before the step that gave way; the rest it decoded
    assert finished[first.request_id].metrics.prefill_tokens == held_call


def test_the_forecast_of_a_first_step_is_not_run_while_a_prompt_waits():
    """Without a head start the prefill node forecasts the decode node's first step (the step-2 FORECAST's queries)
    only while no prompt waits: in a burst, every later prompt would wait a step more for each request ahead of it.
    The last request of the burst gets its forecast; answers stay full transfer's."""
    prompts = _prompts(200, 180, 150)
    full, _ = _generate("full", prompts, 6)
    with _pipeline("smartgen-no-head-start", 0.02) as pipeline:
        runner, real = pipeline.prefill_runner, pipeline.prefill_runner.forecast_next
        outcomes: list[str] = []

        def forecast_next(output, token, *, yield_to=None):
            try:
                queries = real(output, token, yield_to=yield_to)
            except StepYielded:
                outcomes.append("given up")
                raise
            outcomes.append("sent" if queries else "empty")
            return queries

        runner.forecast_next = forecast_next
        ahead = pipeline.generate(prompts, 6)
    assert [r.tokens for r in ahead] == [r.tokens for r in full]
    assert outcomes == ["given up", "given up", "sent"]


def test_a_joiner_whose_next_step_forecast_came_empty_fetches_by_the_second_tokens_step():
    """A step-2 FORECAST comes empty when its prefill node gave that step up for a waiting prompt: the joiner then
    fetches ahead by the queries of the second token's step (one step earlier, most of its picks recur), not
    nothing; a full one is taken as it came. Either way the queries are taken once."""
    from smartgen.engine.decode import DecodeEngine
    from smartgen.engine.layout import KVLayout
    from smartgen.lanes.link import inproc_link

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, num_blocks=4)
    engine = DecodeEngine(layout, num_slots=2, max_tokens=32)
    engine._links.append(inproc_link()[1])  # open() needs a prefill node to address
    second = msg.SecondToken(7, torch.ones(3, 2, 8), torch.ones(3, 2, 8))
    step_one, step_two = {2: torch.full((4, 8), 1.0)}, {2: torch.full((4, 8), 2.0)}
    for after_step_two, expected in (({}, step_one), (step_two, step_two)):
        rid = engine.open(10, get_policy("smartgen-no-head-start"))
        engine._handle(msg.FirstToken(rid, 5, {}, forecast=True))
        engine._handle(msg.Forecast(rid, step_one, second))
        engine._handle(msg.Forecast(rid, after_step_two, step=2))
        assert not engine.forecast_pending(rid, after_second=True)
        taken = engine.take_forecast(rid, after_second=True)
        assert taken is not None and torch.equal(taken[2], expected[2])
        assert engine.take_forecast(rid, after_second=True) is None
    engine.close()
