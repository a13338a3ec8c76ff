"""The prefill node's store is bounded (`--max-store-bytes`): a request that would go over the cap is refused with
the reason before anything is allocated, its client gets 503, and both nodes free everything it had."""

import json

import httpx
import pytest
import torch
from conftest import serve_in_thread, wait_until
from inproc_nodes import decode_node, prefill_node, tiny_parts

from smartgen.engine.layout import KVLayout
from smartgen.engine.pool import PrefillStore, StoreFull
from smartgen.roles.http_api import create_app
from smartgen.roles.limits import PrefillLimits
from smartgen.roles.service import GenerationParams

PROMPT = 100


def test_the_store_refuses_past_its_cap_and_a_release_makes_room():
    layout = KVLayout(4, 2, 8, num_blocks=16)
    need = layout.kv_bytes(PROMPT)
    store = PrefillStore(layout, max_bytes=need + need // 2)
    store.open("a", PROMPT)
    with pytest.raises(StoreFull, match=rf"prefill store full: {need} of {need + need // 2} bytes held by 1 request"):
        store.open("b", PROMPT)
    assert store.num_requests == 1 and store.bytes_held == need  # nothing allocated for the refused one
    store.open("small", PROMPT // 4)  # what fits still goes in
    store.release("a")
    store.open("b", PROMPT)
    with pytest.raises(StoreFull, match="prefill store too small: this prompt's KV needs"):
        store.open("huge", 2 * PROMPT)
    with pytest.raises(ValueError, match="must be positive"):
        PrefillStore(layout, max_bytes=0)


@pytest.fixture(scope="module")
def nodes():
    parts = tiny_parts()
    cap = parts[1].kv_bytes(PROMPT) * 3 // 2  # one request's KV fits, two do not
    prefill = prefill_node(parts, limits=PrefillLimits(max_store_bytes=cap))
    decode = decode_node(parts, [prefill])
    yield prefill, decode
    decode.stop()
    prefill.stop()


def _prompt(seed: int) -> list[int]:
    return torch.randint(3, 90, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_full_store_refuses_with_the_reason_and_the_client_gets_503(nodes):
    prefill, decode = nodes
    prefill.engine.store.open("hog", PROMPT)  # another decode node's request fills most of the store
    try:
        finish = list(decode.scheduler.submit(_prompt(1), GenerationParams(max_tokens=4)).events(timeout=60))[-1]
        assert finish.reason == "overloaded" and "prefill store full" in (finish.error or ""), finish
        with serve_in_thread(create_app(decode.scheduler)) as url:
            body = {"prompt": _prompt(2), "max_tokens": 4}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert "prefill store full" in error["message"] and error["type"] == "service_unavailable"
            # a stream had its 200 before the refusal came: the refusal is its last event, with code 503
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
                events = [line[5:] for line in stream.iter_lines() if line.startswith("data:")]
            assert events[-1].strip() == "[DONE]"
            refusal = json.loads(events[-2])["error"]
            assert refusal["code"] == 503 and "prefill store full" in refusal["message"]
        # nothing is left of the refused requests on either node
        wait_until(lambda: decode.engine.pool.num_free == 4, 10, "the decode node to free the slots")
        assert prefill.engine.store.num_requests == 1 and prefill.engine.num_open == 0
    finally:
        prefill.engine.store.release("hog")
    finish = list(decode.scheduler.submit(_prompt(3), GenerationParams(max_tokens=4)).events(timeout=60))[-1]
    assert finish.reason == "length", finish  # room again: served
    wait_until(lambda: prefill.engine.store.num_requests == 0, 10, "the prefill node to free the request")
