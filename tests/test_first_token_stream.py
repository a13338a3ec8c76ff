"""A first token reaches its client at once, whatever the decode step that follows waits for on the link."""

import time
from contextlib import contextmanager

import torch
from inproc_nodes import decode_node, prefill_node, tiny_parts

from smartgen.roles.service import FinishEvent, GenerationParams, TokenEvent


def test_the_first_token_reaches_the_client_before_the_second_is_computed():
    """partial on a 2 Mbit/s link: the first decode step fetches most of the prompt's KV on demand, so the second
    token is computed well after the first arrives; the client must hold the first before then (it once left with
    the second, after that step)."""
    with _nodes("partial") as (decode, _):
        events, received, node_times = _stream(decode, PROMPT, GenerationParams(max_tokens=3, scheme="partial"))
        finish = events[-1]
        assert isinstance(finish, FinishEvent) and finish.error is None, finish
        assert sorted(received) == [0, 1, 2] and [e.index for e in events[:-1]] == [0, 1, 2]  # each once, in order
        assert finish.usage["fetched_tokens"] > 0, "the test must make the second token wait for the link"
        assert received[0] < node_times[1], (received, node_times)
        assert node_times[0] <= received[0]  # the node's TTFT counts to the token's arrival, not to a later step


PROMPT = torch.randint(3, 90, (200,), generator=torch.Generator().manual_seed(7)).tolist()


@contextmanager
def _nodes(scheme: str):
    """A decode and a prefill node on a 2 Mbit/s link, the decode node's default scheme `scheme`."""
    parts = tiny_parts()
    prefill = prefill_node(parts, link_gbps=0.002)
    decode = decode_node(parts, [prefill], scheme=scheme, link_gbps=0.002)
    try:
        yield decode, prefill
    finally:
        decode.stop()
        prefill.stop()


def _stream(decode, prompt, params):
    handle = decode.scheduler.submit(prompt, params)
    received: dict[int, float] = {}
    node_times: dict[int, float] = {}
    events = []
    for event in handle.events(timeout=120):
        events.append(event)
        if isinstance(event, TokenEvent):
            received[event.index] = time.monotonic()
            node_times[event.index] = event.time
    return events, received, node_times


def _check_full_answer_and_sampling(decode, prompt, events, scheme: str) -> None:
    """`events` (a greedy `scheme` stream) carry full transfer's tokens, which waits for the whole cache; the same
    request sampling gets no token from the prefill node's steps (they are greedy): it decodes from its second."""
    tokens = len(events) - 1
    reference, _, _ = _stream(decode, prompt, GenerationParams(max_tokens=tokens, scheme="full"))
    assert [e.token_id for e in events[:-1]] == [e.token_id for e in reference[:-1]]
    sampled, _, _ = _stream(decode, prompt, GenerationParams(max_tokens=tokens, scheme=scheme, temperature=0.7, seed=3))
    assert isinstance(sampled[-1], FinishEvent) and sampled[-1].error is None, sampled[-1]
    assert sampled[-1].usage["prefill_tokens"] == 1 and len(sampled) == tokens + 1


def test_the_forecast_steps_second_token_reaches_the_client_before_the_decode_node_steps():
    """smartgen on a 2 Mbit/s link: the prefill node's forecast step gives the second token, which leaves at once;
    the decode node's first step (the third token) waits for the link. A request that samples decodes its second
    token itself."""
    with _nodes("smartgen-no-head-start") as (decode, _):
        prompt = PROMPT
        params = GenerationParams(max_tokens=4, scheme="smartgen-no-head-start")
        events, received, node_times = _stream(decode, prompt, params)
        finish = events[-1]
        assert isinstance(finish, FinishEvent) and finish.error is None, finish
        assert [e.index for e in events[:-1]] == [0, 1, 2, 3]  # each once, in order
        assert finish.usage["prefill_tokens"] == 2
        assert finish.usage["fetch_wait"] > 0, "the test must make the decode node's first step wait for the link"
        assert finish.usage["forecast_entries"] > 0  # its first step's picks, asked for as the forecast came
        assert received[1] < node_times[2], (received, node_times)
        assert node_times[1] <= received[1]

        _check_full_answer_and_sampling(decode, prompt, events, "smartgen-no-head-start")


def test_head_start_tokens_reach_the_client_as_the_prefill_node_sends_them():
    """smartgen on a 2 Mbit/s link, alone: the prefill node decodes on from the second token (its head start), and
    each of those tokens is streamed as its FORECAST lands, in order, with full transfer's tokens; a request
    that samples gets none (the prefill node's steps are greedy) and decodes from its second token itself."""
    with _nodes("smartgen") as (decode, prefill):
        events, received, node_times = _stream(decode, PROMPT, GenerationParams(max_tokens=6, scheme="smartgen"))
        finish = events[-1]
        assert isinstance(finish, FinishEvent) and finish.error is None, finish
        assert [e.index for e in events[:-1]] == list(range(6))
        assert finish.usage["prefill_tokens"] == 6 and finish.usage["fetch_wait"] == 0
        # each reached the client after the node counted it at its FORECAST's arrival, and in the order computed
        assert all(node_times[i] <= received[i] for i in range(6)), (received, node_times)
        assert [received[i] for i in range(6)] == sorted(received.values())
        _check_full_answer_and_sampling(decode, PROMPT, events, "smartgen")
        # the prefill node counts the head start's tokens (4 past the second) in /status and /metrics alike
        assert prefill.snapshot()["head_start"] == {"tokens": 4, "steps_yielded": 0}
        metrics = prefill.monitoring.exposition()[0].decode()
        assert "smartgen:head_start_tokens_total 4.0" in metrics
        assert "smartgen:decode_steps_yielded_total 0.0" in metrics
