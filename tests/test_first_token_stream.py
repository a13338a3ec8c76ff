"""A first token reaches its client at once, whatever the decode step that follows waits for on the link."""

import time

import torch
from inproc_nodes import decode_node, prefill_node, tiny_parts

from smartgen.roles.service import FinishEvent, GenerationParams, TokenEvent


def test_the_first_token_reaches_the_client_before_the_second_is_computed():
    """partial on a 2 Mbit/s link: the first decode step fetches most of the prompt's KV on demand, so the second
    token is computed well after the first arrives; the client must hold the first before then (it once left with
    the second, after that step)."""
    parts = tiny_parts()
    prefill = prefill_node(parts, link_gbps=0.002)
    decode = decode_node(parts, [prefill], scheme="partial", link_gbps=0.002)
    try:
        prompt = torch.randint(3, 90, (200,), generator=torch.Generator().manual_seed(7)).tolist()
        handle = decode.scheduler.submit(prompt, GenerationParams(max_tokens=3, scheme="partial"))
        received: dict[int, float] = {}
        node_times: dict[int, float] = {}
        events = []
        for event in handle.events(timeout=120):
            events.append(event)
            if isinstance(event, TokenEvent):
                received[event.index] = time.monotonic()  # the same clock as the node's: one process
                node_times[event.index] = event.time
        finish = events[-1]
        assert isinstance(finish, FinishEvent) and finish.error is None, finish
        assert sorted(received) == [0, 1, 2] and [e.index for e in events[:-1]] == [0, 1, 2]  # each once, in order
        assert finish.usage["fetched_tokens"] > 0, "the test must make the second token wait for the link"
        assert received[0] < node_times[1], (received, node_times)
        assert node_times[0] <= received[0]  # the node's TTFT counts to the token's arrival, not to a later step
    finally:
        decode.stop()
        prefill.stop()
